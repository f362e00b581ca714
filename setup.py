"""Package list for setuptools (everything else is in pyproject.toml).

The Textual UI lives in the top-level ``tui/`` folder but ships inside the package as ``localai.tui``: a
top-level module named ``tui`` would collide with anything else of that name.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["localai", "localai.*"]),
              *(f"localai.{name}" for name in find_packages(include=["tui", "tui.*"]))],
    package_dir={"localai.tui": "tui"},
)
