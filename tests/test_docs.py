"""Documentation that cannot drift from the code: every setting, CLI command and option, HTTP route and Modelfile
PARAMETER has its line in its page, every make target CONTRIBUTING.md names exists, and the README and the pages
keep their size. The site itself is built with ``mkdocs build --strict`` by ``make test`` (``make docs``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "src"
README_LINES = 200
PAGE_LINES = 400


def page(name: str) -> str:
    return (DOCS / name).read_text()


def code_spans(text: str) -> str:
    """The text of a page's inline code and code blocks, where names are written."""
    return "\n".join(re.findall(r"```.*?```|`[^`\n]+`", text, re.S))


# -- settings ------------------------------------------------------------------------------------------------------


def configuration_rows() -> dict[str, str]:
    """``LOCALAI_X`` -> its default cell, from the configuration page's table."""
    rows = {}
    for line in page("configuration.md").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        found = re.fullmatch(r"`(LOCALAI_[A-Z_]+)`", cells[0]) if len(cells) >= 3 else None
        if found:
            rows[found[1]] = cells[1]
    return rows


def default_forms(value: Any) -> list[str]:
    """How a default may be written in the page (a number, a duration, a list as its comma-separated items)."""
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, (int, float)):
        forms = [f"{value:g}", str(int(value))] if float(value).is_integer() else [f"{value:g}"]
        for unit, seconds in (("m", 60), ("h", 3600), ("d", 86400)):
            if value and float(value) % seconds == 0:
                forms.append(f"{int(value // seconds)}{unit}")
        return forms
    if isinstance(value, (list, tuple)):
        return [",".join(map(str, value))] if value else ["none", "unset", "empty"]
    if value is None:
        return []  # any words: "unset", "all cores", "1/16 of memory"...
    return [str(value)]


def test_every_setting_is_on_the_configuration_page_with_its_default() -> None:
    from localai.settings import Settings

    rows = configuration_rows()
    for name, field in Settings.model_fields.items():
        variable = f"LOCALAI_{name.upper()}"
        assert variable in rows, f"{variable} has no row in docs/src/configuration.md"
        cell = rows[variable]
        assert cell.strip("` "), f"{variable}'s default is empty in docs/src/configuration.md"
        default = field.get_default(call_default_factory=True)
        forms = default_forms(default)
        assert not forms or any(form in cell for form in forms), \
            f"{variable}: docs/src/configuration.md says {cell!r}, the default is {default!r}"


def test_every_variable_the_code_reads_is_on_the_configuration_page() -> None:
    read = set()
    for path in (ROOT / "localai").rglob("*.py"):
        read |= set(re.findall(r"""(?:environ\.get\(|getenv\(|environ\[)\s*["'](LOCALAI_[A-Z_]+)""", path.read_text()))
    assert read, "found no environment variable read: the pattern is wrong"
    missing = sorted(read - set(configuration_rows()))
    assert not missing, f"read by the code, not in docs/src/configuration.md: {missing}"


# -- the CLI -------------------------------------------------------------------------------------------------------


def commands() -> list[tuple[str, list[str]]]:
    """Every command path and its long options, from click's own tree."""
    import localai.cli as cli_module
    from localai.cli import bench, cache, daemon, launch, models, pull, rpc, run, serve, service, tui  # noqa: F401

    root = cli_module.cli
    context = click.Context(root)
    found: list[tuple[str, list[str]]] = []

    def walk(command: click.Command, path: list[str]) -> None:
        options = [opt for param in command.params if isinstance(param, click.Option)
                   for opt in param.opts + param.secondary_opts if opt.startswith("--")]
        found.append((" ".join(path), options))
        if isinstance(command, click.Group):
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                assert sub is not None
                walk(sub, [*path, name])

    walk(root, ["localai"])
    return found


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    text = page("cli.md")
    sections = dict(re.findall(r"^## (localai[^\n]*)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    found = commands()
    assert len(found) > 30
    for path, options in found:
        assert path in sections, f"`{path}` has no section in docs/src/cli.md"
        missing = [option for option in options if f"`{option}`" not in sections[path]]
        assert not missing, f"`{path}`: options {missing} are not in its section of docs/src/cli.md"


# -- the HTTP API --------------------------------------------------------------------------------------------------


def routes(items: list[Any], prefix: str = "") -> set[str]:
    """Every path of the app's routes, into the routers it includes (FastAPI keeps them as included routers)."""
    found: set[str] = set()
    for route in items:
        if hasattr(route, "original_router"):
            found |= routes(route.original_router.routes, prefix + getattr(route.include_context, "prefix", ""))
        elif getattr(route, "path", None):
            found.add(prefix + route.path)
    return found


def test_every_route_is_on_the_api_page() -> None:
    from localai.api.app import create_app
    from localai.settings import Settings

    app = create_app(Settings(), None)  # type: ignore[arg-type]  # routes only: no request is served
    text = page("api.md")
    written = {re.sub(r"\{[^}]*\}", "{}", path) for path in re.findall(r"(/[A-Za-z0-9_./{}-]*)", text)}
    paths = routes(app.routes)
    assert len(paths) > 30, f"found only {sorted(paths)}: FastAPI keeps its routes otherwise now"
    missing = sorted(path for path in paths if re.sub(r"\{[^}]*\}", "{}", path) not in written
                     and path not in ("/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"))
    assert not missing, f"routes not in docs/src/api.md: {missing}"


# -- Modelfiles ----------------------------------------------------------------------------------------------------


def test_every_modelfile_parameter_is_on_the_models_page() -> None:
    from localai.models.modelfile import PARAMETERS

    spans = code_spans(page("models.md"))
    missing = sorted(name for name in PARAMETERS if not re.search(rf"(?<![A-Za-z_]){name}(?![A-Za-z_])", spans))
    assert not missing, f"Modelfile parameters not in docs/src/models.md: {missing}"


# -- CONTRIBUTING, sizes, the site ------------------------------------------------------------------------------------


def test_every_make_target_contributing_names_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", (ROOT / "CONTRIBUTING.md").read_text()))
    assert {"demo", "test", "docs", "stress", "fixtures"} <= named
    assert not named - targets, f"CONTRIBUTING.md names make targets that do not exist: {sorted(named - targets)}"


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    first = re.search(r"^## (.*)$", readme, re.M)
    assert first is not None and first[1] == "The two commands"
    assert "make demo" in readme and "make test" in readme


@pytest.mark.parametrize("name", sorted(path.name for path in DOCS.glob("*.md")))
def test_no_page_is_too_long_and_every_page_is_in_the_navigation(name: str) -> None:
    assert len(page(name).splitlines()) <= PAGE_LINES
    assert re.search(rf":\s*{re.escape(name)}\s*$", (ROOT / "docs" / "mkdocs.yml").read_text(), re.M)


def test_the_readmes_links_to_pages_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", (ROOT / "README.md").read_text()):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_the_terminal_ui_picture_is_the_snapshot_the_tests_take() -> None:
    snapshot = ROOT / "tests" / "tui" / "__snapshots__" / "test_snapshots" / "test_chat.svg"
    assert (DOCS / "images" / "tui-chat.svg").read_bytes() == snapshot.read_bytes(), \
        "the chat screen changed: cp tests/tui/__snapshots__/test_snapshots/test_chat.svg docs/src/images/tui-chat.svg"
