"""What the ``sandbox`` package's modules import.

- The server does not import the command line (the circle they once made; the project-wide
  circle check is `tests/test_import_graph.py`).
- The template rule (``sandbox._runtime.template``): the process children fork from never maps
  msgspec, epoll or sockets. Checked here on the text and on a fresh interpreter;
  ``test_spawner`` checks a running template's memory map.
"""

from __future__ import annotations

import subprocess
import sys

from import_walk import import_graph, imported_names, modules

from sandbox.isolation import RUNTIME_DIR, RUNTIME_PACKAGE, site_dirs

# msgspec; epoll (the select module, and selectors over it); sockets
SERVING_MODULES = frozenset({"msgspec", "select", "selectors", "socket", "_socket"})


def test_the_server_does_not_import_the_command_line():
    graph = import_graph(("sandbox",))
    assert "sandbox.server" in graph["sandbox.cli"]  # deferred, inside run_serve: the walk sees it
    assert "sandbox.cli" not in graph["sandbox.server"]


def test_the_template_side_never_imports_what_serving_needs():
    """Neither the template module nor anything of ours it imports names msgspec, select or
    socket, at module level or in a function: whatever of it runs in a template, none of
    them is loaded there."""
    graph = import_graph(("sandbox",))
    seen: set[str] = set()
    todo = ["sandbox._runtime.template"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph[mod])
    assert "sandbox._runtime.children" in seen  # the walk follows our imports
    mods = modules(("sandbox",))
    offending = {m: sorted(names) for m in sorted(seen) if (path := mods[m][0]) is not None
                 and (names := imported_names(path) & SERVING_MODULES)}
    assert not offending


def test_loading_the_worker_loads_nothing_serving_needs():
    """A worker imports its entry module (and with it the controller) before it forks the
    templates: a fresh interpreter, loading the runtime as a worker does, has none of them."""
    code = (
        "import sys, importlib.util as u\n"
        f"sys.path.extend({site_dirs()!r})\n"  # as a worker: msgspec would be importable
        f"s = u.spec_from_file_location({RUNTIME_PACKAGE!r}, {str(RUNTIME_DIR / '__init__.py')!r},"
        f" submodule_search_locations=[{str(RUNTIME_DIR)!r}])\n"
        "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
        f"import {RUNTIME_PACKAGE}.zygote, {RUNTIME_PACKAGE}.template\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", code], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert f"{RUNTIME_PACKAGE}.controller" in out  # what the worker loads was loaded
    assert not SERVING_MODULES & set(out), sorted(SERVING_MODULES & set(out))
