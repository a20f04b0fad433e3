"""The engine package's import graph has no circle, and the SGLang modules depend one way.

Walks every `import` in `asyncrl/engine/` with `ast`: module-level, deferred (inside
functions) and `TYPE_CHECKING` imports all count, since each is a dependency a reader must
follow and a deferred one only hides a circle until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncrl.engine

PKG = "asyncrl.engine"
ROOT = Path(asyncrl.engine.__file__).parent


def _module(path: Path) -> str:
    return PKG if path.name == "__init__.py" else f"{PKG}.{path.stem}"


def import_graph() -> dict[str, set[str]]:
    """Engine module -> the engine modules it imports (anywhere in its source)."""
    modules = {_module(p): p for p in ROOT.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from asyncrl.engine import sglang_weights` names a module, not the package
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path.name}: relative import (the walk reads absolute)")
            graph[mod] |= {t for t in targets if t in modules and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle found by a depth-first walk (each reported once per back edge)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return found


def test_the_engine_package_has_no_import_circle() -> None:
    assert cycles(import_graph()) == []


def test_the_walk_sees_a_circle_when_there_is_one() -> None:
    graph = import_graph()
    graph[f"{PKG}.remote"].add(f"{PKG}.sglang")  # sglang imports remote: now a circle
    assert [f"{PKG}.remote", f"{PKG}.sglang", f"{PKG}.remote"] in cycles(graph) or \
        [f"{PKG}.sglang", f"{PKG}.remote", f"{PKG}.sglang"] in cycles(graph)


def test_sglang_fleet_depends_on_sglang_and_the_router_never_back() -> None:
    graph = import_graph()
    fleet, server, router = f"{PKG}.sglang_fleet", f"{PKG}.sglang", f"{PKG}.sglang_router"
    assert {server, router} <= graph[fleet]
    assert fleet not in graph[server] | graph[router]
    assert router not in graph[server] and server not in graph[router]
