"""The quick start of docs/embedding.md runs as written (on a stand-in for `runs/tiny`) and
prints one line per rollout; every public name the doc's tables promise is importable."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "embedding.md"


@pytest.mark.timeout(240)
def test_the_quick_start_runs(tmp_path) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 14  # it is meant to be short
    assert '"runs/tiny"' in code
    spec = importlib.util.spec_from_file_location("standin", ROOT / "examples" / "standin.py")
    assert spec is not None and spec.loader is not None
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    standin.make_run_dir(tmp_path / "run")  # here: the test process has torch loaded already
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = tmp_path / "quickstart.py"
    script.write_text(code.replace('"runs/tiny"', repr(str(tmp_path / "run"))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=200, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout
    assert all(re.fullmatch(r"q1 (completed|truncated) (0\.0|1\.0) \S+", ln) for ln in lines), lines
    assert "Warning" not in out.stderr, out.stderr


def test_the_names_the_doc_documents_are_exported() -> None:
    import asyncrl

    text = DOC.read_text()
    for name in ("load_policy", "Policy", "rollouts", "rollout_groups", "local_sandbox",
                 "remote_sandbox", "exact_match_reward", "RewardResult", "Rollout", "Problem",
                 "RolloutSettings", "FunctionTool", "PythonTool", "function_tool",
                 "from_environment", "BudgetError", "ModelError", "run_loop",
                 "rubric_reward", "Task", "open_task"):
        assert f"`{name}" in text, name
        assert getattr(asyncrl, name) is not None
    import asyncrl.api

    for name in ("open_task", "exact_match_reward", "rollouts"):  # and from asyncrl.api
        assert getattr(asyncrl.api, name) is not None
    from asyncrl.rollout import RolloutSettings

    for field in RolloutSettings.__struct_fields__:  # every setting has its row
        assert f"| `{field}` |" in text, field
