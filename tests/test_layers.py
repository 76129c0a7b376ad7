"""The architecture, enforced: each layer imports only what it may.

* `wim_service/wim/` (the algorithm) imports neither vLLM, Ray, FastAPI/Starlette nor an HTTP
  client: it runs over any engine that implements `wim.backend`.
* `wim_service/engine/` owns vLLM and imports neither Ray nor FastAPI/Starlette.

Every import counts, at module level or inside a function (a lazy import still couples).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wim_service"
FORBIDDEN = {
    "wim": {"vllm", "ray", "fastapi", "starlette", "httpx", "requests", "aiohttp", "uvicorn"},
    "engine": {"ray", "fastapi", "starlette", "uvicorn"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no module in wim_service/{layer}"
    offences = {
        str(path.relative_to(PACKAGE)): sorted(imported_roots(path) & FORBIDDEN[layer])
        for path in files
    }
    assert not {k: v for k, v in offences.items() if v}


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ray import serve\n    import vllm.v1\n")
    assert imported_roots(module) == {"ray", "vllm"}
