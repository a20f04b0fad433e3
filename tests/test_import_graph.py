"""House rules: no import circle, light entry modules load no torch, no library file over 600 lines.

The graph (`import_walk`) counts every import: module level, deferred in a function, and under
`if TYPE_CHECKING:`. Package-specific rules live beside their packages
(`tests/sandbox/test_template_imports.py`: the template rule;
`tests/engine/test_engine_imports.py`: the SGLang builders' direction).
"""

from __future__ import annotations

import subprocess
import sys

from import_walk import ROOT, circles, import_graph


def test_the_walker_sees_deferred_and_type_only_imports_and_circles() -> None:
    graph = import_graph()
    assert "asyncrl.runtime" in graph["asyncrl.train"]  # under TYPE_CHECKING only
    assert "asyncrl.sft.coldstart" in graph["asyncrl.runtime"]  # inside a function only
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 100, "the walker found too few modules to be reading the packages"
    found = circles(graph)
    detail = {m: sorted(graph[m] & set(c)) for c in found for m in c}
    assert not found, f"import circles: {detail}"


def test_components_never_import_the_orchestration() -> None:
    graph = import_graph(("asyncrl",))
    top = {"asyncrl.train", "asyncrl.runtime"} | {m for m in graph if m.startswith("asyncrl.cli")}
    components = ("asyncrl.rollout", "asyncrl.engine", "asyncrl.algo", "asyncrl.trainer",
                  "asyncrl.tasks", "asyncrl.observe", "asyncrl.prepare", "asyncrl.config",
                  "asyncrl.weightsync", "asyncrl.sft")
    bad = {m: sorted(graph[m] & top) for m in graph if m.startswith(components) and graph[m] & top}
    assert not bad
    leaves = {"asyncrl.errors", "asyncrl.records",
              *(m for m in graph if m == "asyncrl.config" or m.startswith("asyncrl.config."))}
    assert all(graph[m] <= leaves for m in leaves), {m: graph[m] - leaves for m in leaves}


def test_weights_flow_one_way_trainer_to_weightsync_to_engine() -> None:
    """`engine/` never imports `trainer/` (nor the push above both); `trainer/` never imports
    the push either: the trainer is told what was pushed, it does not reach for the engines."""
    graph = import_graph(("asyncrl",))
    def under(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")
    bad = {m: sorted(t for t in graph[m] if under(t, "asyncrl.trainer") or
                     under(t, "asyncrl.weightsync"))
           for m in graph if under(m, "asyncrl.engine")}
    assert not {m: t for m, t in bad.items() if t}, bad
    back = {m: sorted(t for t in graph[m] if under(t, "asyncrl.weightsync"))
            for m in graph if under(m, "asyncrl.trainer")}
    assert not {m: t for m, t in back.items() if t}, back
    assert "asyncrl.engine.base" in graph["asyncrl.weightsync.push"]  # the check can fail


def _fresh_modules(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_config_and_api_types_do_not_import_torch() -> None:
    loaded = _fresh_modules("import asyncrl.config, asyncrl.api")
    assert "asyncrl.config" in loaded and "asyncrl.api" in loaded
    assert "torch" not in loaded
    assert "torch" in _fresh_modules("import asyncrl; asyncrl.LocalEngine")  # the check can fail


def test_every_lazy_export_resolves() -> None:
    import asyncrl

    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None, name
    assert set(asyncrl.__all__) == {"__version__", *asyncrl._EXPORTS}


def test_no_library_file_over_600_lines() -> None:
    # past ~500 lines look for the seam (docs/architecture.md); 600 is where it must be found
    long = {str(p.relative_to(ROOT)): n for pkg in ("asyncrl", "sandbox")
            for p in (ROOT / pkg).rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long
