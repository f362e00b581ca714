"""MLX's matrix products on an optimised BLAS in the tests, where its Linux CPU wheel has the reference one.

The ``mlx-cpu`` wheel links netlib's reference BLAS (``mlx_cpu.libs/libblas-*.so``): a float32 product of SmolLM2's
output head runs at about 2 GFLOPS on this CPU, against 60-70 for OpenBLAS, so the MLX tests spent minutes in
prefill. MLX calls only ``cblas_sgemm``, ``cblas_dgemm`` and ``cblas_cgemm`` from it. numpy already ships OpenBLAS
(64-bit integers, its symbols prefixed ``scipy_`` and suffixed ``64_``), so a three-function library that forwards
the standard names to numpy's, made once with the C compiler, and bound before MLX's own BLAS (``LD_PRELOAD`` for
the daemons the tests start, ``RTLD_GLOBAL`` in the test process) gives MLX the fast one. Real MLX, real OpenBLAS;
the products are the same to float32 rounding (tests/engines/mlx/test_mlx_blas.py). On a Mac MLX uses Accelerate
and this is never built. float16 and bfloat16 products are MLX's own kernels, not BLAS: the test models are float32.

OpenBLAS runs one thread: MLX and the suite's other processes already fill both cores, and OpenBLAS's spinning
threads against them made prefill 3x slower than one thread (measured beside a running suite).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

# cblas enums are ints; numpy's OpenBLAS takes 64-bit sizes and leading dimensions
SOURCE = """\
#include <stdint.h>
typedef int64_t i64;
void scipy_cblas_sgemm64_(int, int, int, i64, i64, i64, float, const float *, i64, const float *, i64, float,
                          float *, i64);
void scipy_cblas_dgemm64_(int, int, int, i64, i64, i64, double, const double *, i64, const double *, i64, double,
                          double *, i64);
void scipy_cblas_cgemm64_(int, int, int, i64, i64, i64, const void *, const void *, i64, const void *, i64,
                          const void *, void *, i64);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                 int ldb, float beta, float *c, int ldc)
{ scipy_cblas_sgemm64_(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); }
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda, const double *b,
                 int ldb, double beta, double *c, int ldc)
{ scipy_cblas_dgemm64_(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); }
void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda, const void *b,
                 int ldb, const void *beta, void *c, int ldc)
{ scipy_cblas_cgemm64_(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); }
"""
FORWARDED = ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_cblas_cgemm64_")
LIBRARY: Path | None = None  # made and bound by set_up() (tests/conftest.py's pytest_configure)


def numpy_openblas() -> Path | None:
    """numpy's bundled OpenBLAS, where it has the three products this forwards to."""
    import numpy

    found = sorted((Path(numpy.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    if not found:
        return None
    library = ctypes.CDLL(str(found[0]))
    return found[0] if all(hasattr(library, name) for name in FORWARDED) else None


def build(cache: Path) -> Path | None:
    """The forwarding library in ``cache`` (made once per OpenBLAS and source), or None where it cannot be made
    here: not Linux, MLX's wheel without the reference BLAS, no numpy OpenBLAS or no C compiler. None only costs
    the MLX tests their speed."""
    if not sys.platform.startswith("linux") or not _mlx_has_reference_blas():
        return None
    openblas, compiler = numpy_openblas(), shutil.which(os.environ.get("CC", "cc"))
    if openblas is None or compiler is None:
        return None
    key = hashlib.sha256(f"{openblas}\n{SOURCE}".encode()).hexdigest()[:12]
    target = cache / f"libmlxblas-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # this process's own source and output: a second session building at once never reads a half-written file
    source, partial = cache / f".mlxblas-{key}.{os.getpid()}.c", cache / f".libmlxblas-{key}.{os.getpid()}.so"
    source.write_text(SOURCE)
    try:
        made = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(source), str(openblas),
                               f"-Wl,-rpath,{openblas.parent}"], capture_output=True, text=True)
    finally:
        source.unlink(missing_ok=True)
    if made.returncode != 0:
        partial.unlink(missing_ok=True)
        return None
    partial.replace(target)  # atomic: whichever session finishes first, the file is whole
    return target


def set_up(cache: Path) -> Path | None:
    """Make the library (``build``) and bind MLX's products to it in this process, before mlx is imported, on one
    OpenBLAS thread; ``daemon_env`` then gives it to the daemons the tests start."""
    global LIBRARY
    LIBRARY = build(cache)
    if LIBRARY is None or "mlx.core" in sys.modules:  # Python loads extensions RTLD_NOW: bound already
        return LIBRARY
    ctypes.CDLL(str(LIBRARY), mode=ctypes.RTLD_GLOBAL)
    # numpy loaded OpenBLAS before any variable could say so: one thread from here on
    threads = getattr(ctypes.CDLL(str(numpy_openblas())), "scipy_openblas_set_num_threads64_", None)
    if threads is not None:
        threads(1)
    return LIBRARY


def daemon_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a daemon the tests start (its workers load MLX): the library preloaded, one OpenBLAS thread. Only
    for daemons: preloaded into every process the tests start, it made Cline's CLI crash (SIGSEGV)."""
    if LIBRARY is None:
        return env
    preload = env.get("LD_PRELOAD", "")
    return {**env, "OPENBLAS_NUM_THREADS": "1",
            "LD_PRELOAD": f"{LIBRARY}:{preload}" if preload else str(LIBRARY)}


def _mlx_has_reference_blas() -> bool:
    from importlib.util import find_spec

    spec = find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "mlx_cpu.libs"
    return any(libs.glob("libblas-*.so*"))
