"""The architecture, enforced: each layer imports only what it may, and nothing in a cycle.

* `wim_service/wim/` (the algorithm) imports neither vLLM, Ray, FastAPI/Starlette nor an HTTP
  client, nor the project's engine or serving layers: it runs over any engine that implements
  `wim.backend`.
* `wim_service/engine/` owns vLLM and imports neither Ray nor FastAPI/Starlette nor the
  serving layer.
* `wim_service/placement/` (where work runs) is as pure as `wim/`: the live router and the
  simulator run the same code; `wim_service/sim/` (the simulator) is held to the same bans.
* No wim_service module imports another in a cycle, and neither do the packages: the
  project's top-level packages, and the serving layer's own packages (`serving/http`,
  `serving/routing`, `serving/replica`, …, its top-level modules each on their own).

Every import counts, at module level, inside a function (a lazy import still couples) or under
`if TYPE_CHECKING:` (a type-only import is coupling too, and hides a cycle from the runtime).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wim_service"
FORBIDDEN = {
    "wim": {
        *("vllm", "ray", "fastapi", "starlette", "httpx", "requests", "aiohttp", "uvicorn"),
        *("wim_service.engine", "wim_service.serving"),
    },
    "engine": {"ray", "fastapi", "starlette", "uvicorn", "wim_service.serving"},
    # Placement is one pure policy, run by the live router and by `wim sim` alike.
    "placement": {
        *("vllm", "ray", "fastapi", "starlette", "httpx", "requests", "aiohttp", "uvicorn"),
        *("wim_service.engine", "wim_service.serving"),
    },
    # The simulator replays traces through that same placement code: as pure as placement.
    "sim": {
        *("vllm", "ray", "fastapi", "starlette", "httpx", "requests", "aiohttp", "uvicorn"),
        *("wim_service.engine", "wim_service.serving"),
    },
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, name: str | None = None) -> set[str]:
    """Every module `path` imports, as a dotted name (relative imports resolved against
    `name`); for `from x import y`, both `x` and `x.y` (y may be a module)."""
    name = name or module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def imported_roots(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_names(path, path.stem)}


def _offends(name: str, banned: set[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no module in wim_service/{layer}"
    offences = {
        str(path.relative_to(PACKAGE)): sorted(
            {n for n in imported_names(path) if _offends(n, FORBIDDEN[layer])}
        )
        for path in files
    }
    assert not {k: v for k, v in offences.items() if v}


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ray import serve\n    import vllm.v1\n")
    assert imported_roots(module) == {"ray", "vllm"}


# -- import cycles --------------------------------------------------------------------------


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` (under `root`) -> the modules of `package` it imports, at any
    level, type-only imports included."""
    modules = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {n for n in imported_names(path, name) if n in modules}
        graph[name] = targets - {name}
    return graph


def unit_of(module: str) -> str:
    """The package a module belongs to for the package graph: a serving subpackage (or a
    top-level serving module on its own), else the project's top-level package."""
    parts = module.split(".")
    if parts[:2] == ["wim_service", "serving"] and len(parts) > 2:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {unit_of(m): set() for m in graph}
    for module, targets in graph.items():
        packages[unit_of(module)].update(unit_of(t) for t in targets)
    # A package importing its own parent's `__init__` (e.g. `wim_service`) is no cycle.
    return {
        p: {t for t in targets if t != p and not p.startswith(t + ".")}
        for p, targets in packages.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_another_in_a_cycle() -> None:
    graph = module_graph(ROOT, "wim_service")
    assert "wim_service.serving.routing.router" in graph["wim_service.serving.ingress"]
    assert cycles(graph) == []


def test_no_package_imports_another_in_a_cycle() -> None:
    packages = package_graph(module_graph(ROOT, "wim_service"))
    assert {"wim_service.serving.http", "wim_service.serving.routing"} <= set(packages)
    assert "wim_service.serving.http" in packages["wim_service.serving.routing"]
    assert cycles(packages) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_type_only_cycle_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "wim_service/__init__.py": "",
            "wim_service/serving/__init__.py": "",
            "wim_service/serving/a/__init__.py": "",
            "wim_service/serving/a/x.py": "from wim_service.serving.b.y import Y\n",
            "wim_service/serving/b/__init__.py": "",
            "wim_service/serving/b/y.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from wim_service.serving.a import x\n"
            ),
            "wim_service/serving/b/z.py": "from ..a.x import X\n",
        },
    )
    graph = module_graph(root, "wim_service")
    assert cycles(graph) == [["wim_service.serving.a.x", "wim_service.serving.b.y"]]
    assert cycles(package_graph(graph)) == [["wim_service.serving.a", "wim_service.serving.b"]]


def test_a_package_cycle_without_a_module_cycle_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "wim_service/__init__.py": "",
            "wim_service/serving/__init__.py": "",
            "wim_service/serving/a/__init__.py": "",
            "wim_service/serving/a/x.py": "def f():\n    from wim_service.serving.b import y\n",
            "wim_service/serving/a/w.py": "",
            "wim_service/serving/b/__init__.py": "",
            "wim_service/serving/b/y.py": "",
            "wim_service/serving/b/z.py": "import wim_service.serving.a.w\n",
        },
    )
    graph = module_graph(root, "wim_service")
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [["wim_service.serving.a", "wim_service.serving.b"]]


def test_the_check_sees_the_projects_own_layers(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from wim_service.serving.http import errors\nimport wim_service.engine\n")
    names = imported_names(module, "wim_service.wim.m")
    assert _offends("wim_service.serving.http.errors", FORBIDDEN["wim"])
    assert {n for n in names if _offends(n, FORBIDDEN["wim"])} == {
        "wim_service.serving.http",
        "wim_service.serving.http.errors",
        "wim_service.engine",
    }


# -- sizes ----------------------------------------------------------------------------------

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_small() -> None:
    """One place per behaviour: a module past 450 lines or a function past 60 holds more than
    one (CONTRIBUTING.md)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(PACKAGE))
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


MAX_TEST_MODULE_LINES = 600


def test_test_modules_stay_small() -> None:
    """A test module past 600 lines tests more than one behaviour: split it by behaviour, in
    the directory of the package whose code it tests (docs/testing.md)."""
    too_long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_TEST_MODULE_LINES
    ]
    assert too_long == []
