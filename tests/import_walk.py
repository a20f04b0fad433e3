"""The import graph of the project's packages, read from the source with `ast` (for tests).

Every `import` statement counts: at module level, deferred inside a function, or under
`if TYPE_CHECKING:`. A deferred or type-only import that closes a circle still ties the two
modules together (a name looked up while the other is half-initialised, or a type that cannot
be named without the other); it only hides the circle until the function runs. An edge goes to
the module named, not to the packages above it (imported implicitly first): a parent package is
an edge only when named explicitly (`from . import name` of a name that is no submodule).
C extensions count as modules, so `from . import _ext` names the extension, not its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(packages: tuple[str, ...] = ("asyncrl", "sandbox")) -> dict[str, tuple[Path | None, bool]]:
    """name -> (source or None for a C extension, is a package)."""
    out: dict[str, tuple[Path | None, bool]] = {}
    for pkg in packages:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
        for p in (ROOT / pkg).rglob("*.so"):
            out[".".join([*p.relative_to(ROOT).parts[:-1], p.name.split(".")[0]])] = (None, False)
    return out


def import_graph(packages: tuple[str, ...] = ("asyncrl", "sandbox")) -> dict[str, set[str]]:
    """module -> the project's modules it imports anywhere in its text."""
    mods = modules(packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        if path is None:
            continue
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def package_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """package -> the graph of its direct children (modules and subpackages): an edge c1 -> c2
    where any module in or under c1 imports any module in or under c2. A package's `__init__`
    is not its own child; the package itself counts, namespace packages included."""
    out: dict[str, dict[str, set[str]]] = {}
    for mod in graph:
        parts = mod.split(".")
        for i in range(1, len(parts)):
            out.setdefault(".".join(parts[:i]), {})
    for pkg, children in out.items():
        def child(m: str, pkg: str = pkg) -> str | None:
            if not m.startswith(pkg + "."):
                return None
            return pkg + "." + m[len(pkg) + 1:].split(".")[0]

        for mod, targets in graph.items():
            if (a := child(mod)) is None:
                continue
            children.setdefault(a, set())
            for t in targets:
                if (b := child(t)) is not None and b != a:
                    children[a].add(b)
                    children.setdefault(b, set())
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
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
