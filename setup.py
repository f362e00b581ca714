"""Package list for setuptools (everything else is in pyproject.toml).

The Textual UI lives in the top-level ``tui/`` folder but ships inside the package as ``localai.tui``: a
top-level module named ``tui`` would collide with anything else of that name. The library of Modelfiles
(``modelfiles/``) and the service files (``packaging/``) ship the same way, as ``localai.modelfiles`` and
``localai.packaging``: data inside the package is found wherever the wheel is installed (a pipx or uv venv,
``pip install --user``, ``--target``), which files beside ``sys.prefix`` are not.
"""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["localai", "localai.*"]),
              *(f"localai.{name}" for name in find_packages(include=["tui", "tui.*"])),
              "localai.modelfiles", "localai.packaging",
              # a family folder whose name is a valid identifier (gemma3) looks like a package to setuptools,
              # which warns unless it is listed; the others (llama3.1) are plain data folders of localai.modelfiles
              *(f"localai.modelfiles.{path.name}" for path in sorted(Path("modelfiles").iterdir())
                if path.is_dir() and path.name.isidentifier())],
    package_dir={"localai.tui": "tui", "localai.modelfiles": "modelfiles", "localai.packaging": "packaging"},
)
