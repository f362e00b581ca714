"""The built wheel is what pipx and uv install: it builds without warnings, and from an install of it (not the
checkout) localai finds its library of Modelfiles, its TUI styles and its service templates."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (path,) = out.glob("localai-*.whl")
    return path, build.stdout + build.stderr


def test_the_wheel_builds_without_warnings_and_holds_the_data(wheel: tuple[Path, str]) -> None:
    path, log = wheel
    warnings = [line for line in log.splitlines()
                if "warning" in line.lower() and "byte-compiling is disabled" not in line]
    assert not warnings, "\n".join(warnings)
    names = set(zipfile.ZipFile(path).namelist())
    shipped = {name.split("/", 1)[1] for name in names if name.startswith("localai/modelfiles/")}
    in_tree = {p.relative_to(ROOT / "modelfiles").as_posix() for p in (ROOT / "modelfiles").glob("*/*.Modelfile")}
    assert shipped == {f"modelfiles/{name}" for name in in_tree}
    assert {"localai/packaging/localai.service", "localai/packaging/dev.localai.daemon.plist",
            "localai/tui/app.tcss", "localai/py.typed"} <= names
    assert not any(name.startswith(("modelfiles/", "packaging/", "tui/")) for name in names)  # nothing top-level
    metadata = zipfile.ZipFile(path).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata and "License-File: LICENSE" in metadata
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)


def test_an_installed_wheel_finds_its_library_and_service_files(wheel: tuple[Path, str], tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                              str(target), str(wheel[0])], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("import localai, localai.models.library as library, localai.service as service; "
             "print(localai.__file__); print(len(library.entries())); "
             "print(min(str(e.path) for e in library.entries())); "
             "print(service.Service('systemd').render().decode().splitlines()[0])")
    env = {**os.environ, "PYTHONPATH": str(target), "LOCALAI_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    module, count, first, unit = done.stdout.splitlines()
    assert module.startswith(str(target))  # the installed copy, not the checkout
    assert int(count) == len(list((ROOT / "modelfiles").glob("*/*.Modelfile")))
    assert first.startswith(str(target / "localai" / "modelfiles"))
    assert unit.startswith("# Written by `localai service install`")
    listed = subprocess.run([sys.executable, "-m", "localai", "list", "--library"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "qwen2.5-coder:7b" in listed.stdout, listed.stderr
