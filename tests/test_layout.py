"""The rules of the house (../shared/design/layout.md), read from the code: each module's imports go down the
rooms, never up; the worker process loads only what it needs; no new import cycle; tests/ mirrors the packages.

A room imports downward only: api -> runtime -> workers/upstreams -> engines/promptcache/models -> foundations,
with the front ends (client, agents, daemon, bench, cli, tui) above them all. A new module must be given a room
here (and in the tree in docs/src/architecture.md) before it can land.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePath, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
FOUNDATIONS = {"localai", "localai.schema", "localai.errors", "localai.settings", "localai.paths",
               "localai.protocol", "localai.metrics", "localai.text"}
LEVELS = {
    "foundations": 0,
    "engines": 1, "promptcache": 1, "models": 1,
    "workers": 2, "upstreams": 2,
    "runtime": 3,
    "api": 4,
    "client": 5, "conversations": 5, "agents": 5,
    "daemon": 6, "service": 6, "bench": 6,
    "tui": 7,
    "cli": 8,
}
SIDEWAYS = {("engines", "promptcache")}  # an engine hands the store bytes and a layout; never the other way
# The worker process: an engine crash must cost one worker, so it loads no daemon code.
WORKER_ROOMS = {"foundations", "engines", "promptcache"}
WORKER_MAIN = "localai.workers.worker"
FRONT_ENDS_NEVER = {"runtime", "api", "workers", "upstreams", "engines"}  # cli/ and tui/ go through client.py
CYCLES_ALLOWED_IN = {"cli", "tui"}  # click's command registration; the Textual app and its screens
# The API dialects: each maps its own wire format to the internal one and back, and what two of them share lives in
# api/common.py, so no dialect leans on another. The Responses API's WebSocket transport and its stored responses
# are that dialect's own modules.
DIALECTS = {"localai.api.openai": "openai", "localai.api.anthropic": "anthropic", "localai.api.ollama": "ollama",
            "localai.api.ollama_models": "ollama",
            "localai.api.responses": "responses", "localai.api.responses_compaction": "responses",
            "localai.api.responses_socket": "responses",
            "localai.api.response_store": "responses"}
# tests/<package>/ holds a package's tests (tests/runtime/formats/ a sub-package's, tests/engines/mlx/ a module's), the
# foundations' tests sit at the root; inside a package's folder, a tier's sub-folder says what kind of test it holds.
TEST_TIERS = {
    "daemon": "the package's tests through a real `localai serve`",
    "clients": "real client libraries against a real daemon (`make test-clients`)",
    "gpu": "the GPU tier (`make test-gpu`)",
    "stress": "the abuse harness (`make stress`)",
}
NOT_TESTS = {"__pycache__", "node_modules"}


def modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((ROOT / "localai", "localai"), (ROOT / "tui", "localai.tui")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def room(module: str) -> str:
    if module == "localai.__main__":
        return "cli"  # `python -m localai` is the CLI
    return "foundations" if module in FOUNDATIONS else module.split(".")[1]


def imports(module: str) -> Iterator[tuple[str, int]]:
    """Every localai module ``module`` imports (at the top, in a function, under TYPE_CHECKING alike)."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "localai" or target.startswith("localai."):
                while target not in MODULES:
                    target = target.rsplit(".", 1)[0]
                if target != module:
                    yield target, node.lineno


def private_reaches(module: str, source: str) -> list[str]:
    """Private names (``_x``) ``module`` takes from another package: imported by name, or read off an imported module
    (``renderer._pool``). Inside a package they are the package's own business; across packages they are a seam
    nobody declared."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the localai module it is bound to
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("localai.") and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("localai"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif _private(alias.name) and room(node.module) != room(module):
                    bad.append(f"{module}:{node.lineno} imports {alias.name} from {node.module}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            target = aliases.get(node.value.id)
            if target is not None and room(target) != room(module):
                bad.append(f"{module}:{node.lineno} reads {target}.{node.attr}")
    return bad


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_takes_a_private_name_from_another_package() -> None:
    bad = [line for module, path in MODULES.items() for line in private_reaches(module, path.read_text())]
    assert not bad, "private names used across packages (make them public, or move the code):\n" + "\n".join(bad)


def test_every_module_has_a_room() -> None:
    unplaced = sorted(m for m in MODULES if room(m) not in LEVELS)
    assert not unplaced, f"give these a room in tests/test_layout.py and docs/src/architecture.md's tree: {unplaced}"


def files_under_tests() -> list[PurePosixPath]:
    tests, found = ROOT / "tests", []
    for folder, subfolders, names in os.walk(tests):
        subfolders[:] = [name for name in subfolders if name not in NOT_TESTS]  # node_modules may be large
        found += [PurePosixPath(Path(folder, name).relative_to(tests).as_posix()) for name in names]
    return found


def misplaced_tests(files: Iterable[PurePosixPath], modules: Mapping[str, PurePath]) -> list[str]:
    """The folders of Python under tests/ (``files`` relative to it) that name no package of localai/ (or the TUI),
    nor a module or a tier (TEST_TIERS) inside one, or are no package (same-named test files would clash). Folders
    without Python (chat templates, snapshots, the node client) are data and not asked."""
    code = [f for f in files if f.suffix == ".py" and not NOT_TESTS & set(f.parts)]
    folders = {f.parents[i].parts for f in code for i in range(len(f.parts) - 1)}
    packaged = {f.parent.parts for f in code if f.name == "__init__.py"}
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    bad = []
    for folder in sorted(folders):
        where = f"localai.{folder[0]}"
        mirrors = where in packages
        for part in folder[1:]:
            if part not in TEST_TIERS:
                where = f"{where}.{part}"
                mirrors = mirrors and where in modules
        if not mirrors:
            bad.append(f"tests/{'/'.join(folder)}: names no package of localai/, nor a module or tier in one")
        elif folder not in packaged:
            bad.append(f"tests/{'/'.join(folder)}: has no __init__.py")
    return bad


def test_every_test_folder_names_a_package() -> None:
    bad = misplaced_tests(files_under_tests(), MODULES)
    assert not bad, "put these tests beside their package's (tests/<package>/, a tier of TEST_TIERS in it):\n" + (
        "\n".join(bad))


def edges() -> list[tuple[str, str, int]]:
    return [(module, target, line) for module in MODULES for target, line in imports(module)]


def upward(found: list[tuple[str, str, int]]) -> list[str]:
    """The imports that run up the rooms (or sideways where that is not allowed)."""
    bad = []
    for module, target, line in found:
        here, there = room(module), room(target)
        if here != there and (here, there) not in SIDEWAYS and LEVELS[there] >= LEVELS[here]:
            bad.append(f"{module}:{line} ({here}) imports {target} ({there})")
    return bad


def crossing(found: list[tuple[str, str, int]]) -> list[str]:
    """Front ends importing what they must reach through the daemon."""
    return [f"{module}:{line} imports {target}" for module, target, line in found
            if room(module) in ("cli", "tui") and room(target) in FRONT_ENDS_NEVER]


def between_dialects(found: list[tuple[str, str, int]]) -> list[str]:
    """One API dialect importing another's module."""
    return sorted({f"{module}:{line} imports {target}" for module, target, line in found
                   if module in DIALECTS and target in DIALECTS and DIALECTS[module] != DIALECTS[target]})


def test_imports_only_go_down() -> None:
    assert not upward(edges()), "imports running up the rooms:\n" + "\n".join(upward(edges()))


def test_the_cli_and_the_tui_reach_the_daemon_only_through_the_client() -> None:
    assert not crossing(edges()), "\n".join(crossing(edges()))


def test_dialects_do_not_import_each_other() -> None:
    gone = sorted(set(DIALECTS) - set(MODULES))
    assert not gone, f"DIALECTS names modules that are gone: {gone}"
    assert not between_dialects(edges()), "move what they share to api/common.py:\n" + "\n".join(
        between_dialects(edges()))


def test_the_worker_process_loads_only_engines_the_cache_and_foundations() -> None:
    seen, todo = {WORKER_MAIN}, [WORKER_MAIN]
    while todo:
        for target, _ in imports(todo.pop()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    extra = sorted(m for m in seen - {WORKER_MAIN} if room(m) not in WORKER_ROOMS and m != "localai.workers")
    assert not extra, f"the worker process would load {extra}"


def test_no_import_cycle_outside_the_cli_and_tui() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        graph[module] = {target for target, _ in imports(module)}
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    bad = [c for c in cycles if len({room(m) for m in c}) > 1 or room(c[0]) not in CYCLES_ALLOWED_IN]
    assert not bad, f"import cycles: {bad}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_the_rules_catch_what_they_forbid() -> None:
    """The checks above can fail: the imports this layout cut, put back, are each caught."""
    put_back = [("localai.models.pull", "localai.workers.scheduler", 1),  # an import running up
                ("localai.promptcache.store", "localai.engines.engine", 2),  # sideways the wrong way
                ("localai.tui.screens.cache", "localai.cli.models", 3),  # the TUI through the CLI
                ("localai.engines.serving", "localai.promptcache.store", 4)]  # allowed
    assert [line.split(":")[0] for line in upward(put_back)] == [
        "localai.models.pull", "localai.promptcache.store", "localai.tui.screens.cache"]
    assert crossing([("localai.cli.cache", "localai.runtime.divergence", 5)]) != []
    assert between_dialects([("localai.api.ollama", "localai.api.openai", 6),  # a dialect leaning on another
                             ("localai.api.responses_socket", "localai.api.responses", 7),  # within one dialect
                             ("localai.api.ollama", "localai.api.common", 8)]) == [  # what they share
        "localai.api.ollama:6 imports localai.api.openai"]
    cycles = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert sorted(sorted(c) for c in cycles if len(c) > 1) == [["a", "b", "c"]]
    assert room("localai.text") == "foundations" and room("localai.tui.app") == "tui"
    reaching = ("from localai.runtime.runtime import _close_quietly\n"  # across packages: caught
                "from localai.models import renderer\n"
                "renderer._pool()\n"  # a private name off another package's module: caught
                "from localai.api.common import _helper\n"  # inside its own package: allowed
                "from localai.protocol import __version__\n")  # a dunder: allowed
    assert private_reaches("localai.api.openai", reaching) == [
        "localai.api.openai:1 imports _close_quietly from localai.runtime.runtime",
        "localai.api.openai:3 reads localai.models.renderer._pool"]
    tree = [PurePosixPath(f) for f in (
        "conftest.py", "test_settings.py", "templates/qwen3-coder.jinja",  # the foundations' tests; data
        "api/__init__.py", "api/test_limits.py", "api/daemon/__init__.py", "api/daemon/test_openai.py",
        "api/daemon/clients/__init__.py", "api/daemon/clients/node/drive.mjs",
        "api/daemon/clients/node/node_modules/flatted/python/flatted.py",  # an npm package's own Python
        "runtime/__init__.py", "runtime/formats/__init__.py", "engines/__init__.py", "engines/mlx/__init__.py",
        "server/__init__.py", "server/test_openai.py",  # a folder named after no package
        "gpu/__init__.py", "gpu/test_gpu.py",  # a tier outside any package
        "schema/__init__.py", "schema/test_schema.py",  # a foundation module is no package
        "api/sockets/__init__.py", "api/sockets/test_ws.py",  # neither a module of api/ nor a tier
        "workers/test_scheduler.py",  # no __init__.py
    )]
    assert misplaced_tests(tree, MODULES) == [
        "tests/api/sockets: names no package of localai/, nor a module or tier in one",
        "tests/gpu: names no package of localai/, nor a module or tier in one",
        "tests/schema: names no package of localai/, nor a module or tier in one",
        "tests/server: names no package of localai/, nor a module or tier in one",
        "tests/workers: has no __init__.py"]
