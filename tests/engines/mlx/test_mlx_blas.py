"""MLX's float32 products on numpy's OpenBLAS (tests/mlxblas.py) are the products numpy computes, transposed or
not, with and without the accumulate that MLX's addmm passes as beta."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import mlxblas
from tests.conftest import start_daemon

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX uses Accelerate on a Mac")


def library() -> Path:
    assert mlxblas.LIBRARY is not None, "the forwarding library was not made (a C compiler, numpy's OpenBLAS)"
    return mlxblas.LIBRARY


def mapped(pid: int | str) -> bool:
    return str(library()) in Path(f"/proc/{pid}/maps").read_text()


def test_the_suite_binds_mlx_to_openblas_here_and_in_its_daemons_only(tmp_path: Path) -> None:
    assert mapped("self"), "the test process did not load the forwarding library"
    with start_daemon(tmp_path / "home") as daemon:
        assert mapped(daemon.process.pid), "a daemon the tests start runs without it"
        assert str(library()) not in daemon.env.get("LD_PRELOAD", "")  # its CLI commands and agents: without
    child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"], capture_output=True,
                           text=True, check=True)
    assert str(library()) not in child.stdout


@pytest.mark.parametrize("shape", [(1, 576, 49152), (171, 576, 300), (7, 33, 5)])
def test_mlx_float32_products_on_openblas_equal_numpys(shape: tuple[int, int, int]) -> None:
    import mlx.core as mx

    m, k, n = shape
    rng = np.random.default_rng(7)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (m, n)))
    assert np.allclose(np.array(mx.array(a) @ mx.array(b)), a @ b, rtol=1e-4, atol=1e-3)
    assert np.allclose(np.array(mx.array(a.T.copy()).T @ mx.array(b)), a @ b, rtol=1e-4, atol=1e-3)
    assert np.allclose(np.array(mx.array(a) @ mx.array(b.T.copy()).T), a @ b, rtol=1e-4, atol=1e-3)
    assert np.allclose(np.array(mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=0.5, beta=2.0)),
                       2.0 * c + 0.5 * (a @ b), rtol=1e-4, atol=1e-3)


def test_the_forwarding_library_calls_numpys_openblas() -> None:
    openblas = mlxblas.numpy_openblas()
    assert openblas is not None
    sgemm = ctypes.CDLL(str(library())).cblas_sgemm
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros((2, 4), dtype=np.float32)
    pointer = ctypes.POINTER(ctypes.c_float)
    sgemm(101, 111, 111, 2, 4, 3, ctypes.c_float(1.0), a.ctypes.data_as(pointer), 3, b.ctypes.data_as(pointer), 4,
          ctypes.c_float(0.0), out.ctypes.data_as(pointer), 4)  # row-major, neither transposed
    assert out.tolist() == (a @ b).tolist()
