"""``localai tui``'s command line: options, and Textual never imported by --help or other verbs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localai.cli.tui import parse_options
from localai.errors import InvalidRequest


def test_help_does_not_import_textual() -> None:
    code = ("import sys; from localai.cli import cli; import localai.cli.tui, localai.cli.run; "
            "print('textual' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    shown = subprocess.run([sys.executable, "-m", "localai", "tui", "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "F1 home" in shown.stdout and "--option" in shown.stdout


def test_options_are_typed_like_modelfile_parameters() -> None:
    assert parse_options(("num_predict=64", "temperature=0.2", "stop=END", "stop=###")) == {
        "num_predict": 64, "temperature": 0.2, "stop": ["END", "###"]}
    with pytest.raises(InvalidRequest, match="num_predict must be an integer"):
        parse_options(("num_predict=many",))
    with pytest.raises(InvalidRequest, match="NAME=VALUE"):
        parse_options(("temprature=1",))


def test_the_tui_is_not_a_top_level_module() -> None:
    code = "import importlib.util, localai.tui; print(importlib.util.find_spec('tui') is None, localai.tui.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert result.stdout.split() == ["True", "localai.tui"]
