"""Every program in examples/ runs as a user would run it, and prints what docs/embedding.md
says it prints; none of them writes a warning or a progress bar."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _run(name: str) -> tuple[list[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                         text=True, timeout=150, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines(), out.stderr


def test_every_example_is_tested() -> None:
    here = Path(__file__).read_text()
    for path in (ROOT / "examples").glob("*.py"):
        assert path.name == "standin.py" or f'"{path.name}"' in here, path.name


def test_rollouts_with_a_custom_tool_and_reward() -> None:
    lines, err = _run("rollouts_custom.py")
    assert lines[:3] == ["policy: format=markdown max_turns=3 max_response_tokens=200",
                         "direct call multiply(6, 7) -> 42",
                         "direct call python -> ok 391"]
    rows = [re.fullmatch(r"rollout (q[12]) status=(completed|truncated) reward=(0\.0|0\.1|1\.0) "
                         r"tokens=(\d+) tool_calls=(\d+)", line) for line in lines[3:-1]]
    assert all(rows), lines
    # 2 samples each in the curriculum's format, then 1 each with Hermes and the custom tool
    assert sorted(m.group(1) for m in rows if m) == ["q1"] * 3 + ["q2"] * 3
    assert all(int(m.group(4)) <= 64 for m in rows if m)  # settings_with(max_response_tokens=64)
    assert lines[-1] == "done"
    assert "Warning" not in err and "Loading weights" not in err, err


def test_the_sandbox_as_a_library() -> None:
    lines, err = _run("sandbox_library.py")
    assert lines[0] in ("isolation: jail", "isolation: process")
    assert lines[1:] == ["'print(sum(range(10)))': ok 45",
                         "'print(input()[::-1])': ok desserts",
                         "'1 / 0': error ZeroDivisionError: division by zero",
                         "'while True: pass': timeout ",
                         "client: ok 2432902008176640000 exit=0"]
    assert err == ""


def test_the_sandbox_over_http_with_a_token() -> None:
    lines, _ = _run("sandbox_http.py")
    assert lines == ["node up: True",
                     "call: ok 1267650600228229401496703205376",
                     "batch: ['0', '1', '4', '9', '16']",
                     "wrong token refused: AuthError"]
