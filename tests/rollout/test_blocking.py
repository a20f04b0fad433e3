"""Synchronous user code (a sync tool, a text environment's step, a sync reward) runs on daemon
threads: one that never returns is cut by its deadline, named, and does not keep the process
alive (issue 54, H1)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from micro_config import ROOT, RUN_ENV

from asyncrl.rollout import blocking


async def test_an_abandoned_call_is_named_until_it_returns() -> None:
    release = threading.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await blocking.call_sync(release.wait, what="tool 'stuck'")
    assert [w for w, _ in blocking.stuck()] == ["tool 'stuck'"]
    assert "tool 'stuck'" in blocking.describe_stuck()
    (t,) = [t for t in threading.enumerate() if t.name.startswith("asyncrl-sync:")]
    assert t.daemon  # never joined at exit
    release.set()
    t.join(5)
    assert blocking.stuck() == [] and blocking.describe_stuck() == ""


async def test_results_and_exceptions_come_back() -> None:
    assert await blocking.call_sync(lambda a, b=0: a + b, 2, b=3, what="add") == 5
    with pytest.raises(ZeroDivisionError):
        await blocking.call_sync(lambda: 1 / 0, what="div")
    assert blocking.stuck() == []


HUNG_TOOL = """
import asyncio, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from asyncrl import function_tool, run_loop

def sleepy(x: int) -> str:
    time.sleep(3600)
    return "never"

async def main():
    tool = function_tool(sleepy, timeout_s=1.0)
    out = await tool({"x": 1})
    print("status", out.status.value, out.error)

run_loop(main())
print("returned")
"""

HUNG_ENV = """
import asyncio, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from asyncrl import run_loop
from asyncrl.records import Problem, Rollout
from asyncrl.tasks.bridges.textenv import TextEnvRunner

class Env:
    def step(self, action):
        time.sleep(3600)

async def main():
    runner = TextEnvRunner({"p": Problem(id="p", question="q", answer="a")}, lambda p: Env())
    try:
        async with asyncio.timeout(1.0):
            await runner.turn(Rollout(rollout_id="r", prompt_id="p", group_id="g",
                                       policy_version=0, prompt_ids=[1]), "guess 3")
    except TimeoutError:
        print("cut")

run_loop(main())
print("returned")
"""


@pytest.mark.parametrize("program,what", [(HUNG_TOOL, "tool 'sleepy'"),
                                          (HUNG_ENV, "environment step")],
                         ids=["sync_tool", "env_step"])
def test_an_embedding_program_whose_sync_call_hangs_ends(tmp_path, program, what) -> None:
    """Before: `run_loop` never returned (the default executor's thread was joined at
    shutdown) and one SIGINT did not end it. Now it ends right after its 1 s deadline and the
    log names what hung."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(program))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=RUN_ENV,
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned" in proc.stdout
    assert "sync_call_abandoned" in proc.stderr and what in proc.stderr
    assert "sync_calls_stuck" in proc.stderr  # and again when the loop ends
    assert took < 30, took  # import time on a busy machine; the hang was forever
