"""The SGLang builders (`sglang_fleet`) depend on the server client and the router, never back.

`sglang` and `sglang_router` once imported each other; the project-wide circle check is
`tests/test_import_graph.py`.
"""

from __future__ import annotations

from import_walk import import_graph

PKG = "asyncrl.engine"


def test_sglang_fleet_depends_on_sglang_and_the_router_never_back() -> None:
    graph = import_graph(("asyncrl",))
    fleet, server, router = f"{PKG}.sglang.fleet", f"{PKG}.sglang.engine", f"{PKG}.sglang.router"
    assert {server, router} <= graph[fleet]
    assert fleet not in graph[server] | graph[router]
    assert router not in graph[server] and server not in graph[router]
