"""What the ``sandbox`` package's modules import.

- No import circle: one makes a module's behaviour depend on which side was imported first (a
  name looked up while the other is half-initialised); deferred imports inside functions hide
  one until the function runs, so both kinds count here.
- The template rule (``sandbox._runtime.template``): the process children fork from never maps
  msgspec, epoll or sockets. Checked here on the text and on a fresh interpreter;
  ``test_spawner`` checks a running template's memory map.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sandbox
from sandbox.isolation import RUNTIME_DIR, RUNTIME_PACKAGE, site_dirs

PACKAGE_DIR = Path(sandbox.__file__).resolve().parent
# msgspec; epoll (the select module, and selectors over it); sockets
SERVING_MODULES = frozenset({"msgspec", "select", "selectors", "socket", "_socket"})


def _modules() -> dict[str, tuple[Path | None, bool]]:
    """Every module of the package: name -> (source, is a package); C extensions too (their
    source is None), so ``from . import _ext`` names the extension, not its package."""
    base = PACKAGE_DIR.parent
    out: dict[str, tuple[Path | None, bool]] = {}
    for p in PACKAGE_DIR.rglob("*.py"):
        parts = list(p.relative_to(base).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    for p in PACKAGE_DIR.rglob("*.so"):
        parts = [*p.relative_to(base).parts[:-1], p.name.split(".")[0]]
        out[".".join(parts)] = (None, False)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its text (module level, inside
    functions, under ``TYPE_CHECKING``). A parent package, imported implicitly before its
    submodule, is an edge only when named explicitly (``from . import name`` of a name that is
    no submodule)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        if path is None:
            continue
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here[:len(here) - node.level + 1]
                    origin = ".".join(parts + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a non-module: its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def imported_names(path: Path) -> set[str]:
    """Every absolute module name imported anywhere in the file's text, top-level part only."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_deferred_imports_and_circles():
    """The checker itself: a circle closed only by an import inside a function is found."""
    graph = import_graph()
    assert "sandbox.server" in graph["sandbox.cli"]  # deferred, inside run_serve
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_package():
    graph = import_graph()
    found = cycles(graph)
    detail = {m: sorted(graph[m] & set(c)) for c in found for m in c}
    assert not found, f"import circles: {detail}"


def test_the_server_does_not_import_the_command_line():
    assert "sandbox.cli" not in import_graph()["sandbox.server"]


def test_the_template_side_never_imports_what_serving_needs():
    """Neither the template module nor anything of ours it imports names msgspec, select or
    socket, at module level or in a function: whatever of it runs in a template, none of
    them is loaded there."""
    graph = import_graph()
    seen: set[str] = set()
    todo = ["sandbox._runtime.template"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph[mod])
    assert "sandbox._runtime.children" in seen  # the walk follows our imports
    mods = _modules()
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
