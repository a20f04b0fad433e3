"""The quick start of docs/embedding.md runs as written (on a stand-in for `runs/tiny`) and
prints one line per rollout; every public name the doc's tables promise is importable."""

from __future__ import annotations

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
    make = ("import sys; sys.path.insert(0, 'examples'); from standin import make_run_dir; "
            f"from pathlib import Path; make_run_dir(Path({str(tmp_path / 'run')!r}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", make], check=True, cwd=ROOT, env=env, timeout=120)
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
