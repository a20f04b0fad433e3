"""Progress display state: ETA arithmetic, what the lines say, counting through a runner's
tools and reward function, and never a display on a non-terminal."""

from __future__ import annotations

import io
import types
from typing import Any

from asyncrl.observe.progress import (
    RunProgress,
    StagePlan,
    instrument,
    progress_display,
    should_show,
)
from asyncrl.records import ToolStatus
from asyncrl.rollout.tools import FunctionTool, ToolOutcome


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


STAGES = [StagePlan("sft", "sft", 100), StagePlan("rl-a", "rl", 10), StagePlan("rl-b", "rl", 20)]


def test_eta_uses_the_measured_step_time_of_each_kind() -> None:
    clock = Clock()
    p = RunProgress("tiny", STAGES, clock=clock)
    p.stage_start(0)
    assert p.eta() == (None, None)
    clock.t += 10
    p.step(20, 0, loss=2.0)  # 0.5 s per SFT step
    stage_left, run_left = p.eta()
    assert stage_left == 40.0 and run_left is None  # no RL step time known yet
    p.stage_start(1)
    clock.t += 30
    p.step(2, 2, reward=0.25)  # 15 s per RL step
    assert p.eta() == (8 * 15.0, 8 * 15.0 + 20 * 15.0)
    head, figures, _ = p.lines()
    assert "stage 2/3 rl-a (rl)  step 2/10" in head and "ETA stage 2m00s, run 7m00s" in head
    assert figures.startswith("reward 0.250")


def test_a_resumed_stage_times_only_the_steps_it_ran() -> None:
    clock = Clock()
    p = RunProgress("tiny", STAGES, clock=clock)
    p.stage_start(1, steps_done=6)
    clock.t += 8
    p.step(8, 8)
    assert p.eta()[0] == 2 * 4.0


def test_lines_show_loss_accuracy_rollouts_and_tool_errors() -> None:
    clock = Clock()
    p = RunProgress("tiny", STAGES, clock=clock)
    p.stage_start(0)
    p.step(10, 0, loss=1.23456)
    p.evaluated(0, 0.625)
    p.rollouts_requested(8)
    for _ in range(3):
        p.rollout_done()
    for s in (ToolStatus.OK, ToolStatus.OK, ToolStatus.ERROR, ToolStatus.TIMEOUT):
        p.tool_call(s)
    _, figures, work = p.lines()
    assert figures == "SFT loss 1.2346  held-out accuracy 62.5% (step 0)"
    assert work == ("rollouts 3 done / 5 in flight  tool calls 0.1/s (4 total, 50% failed)  "
                    "sandbox errors 1")
    clock.t += 31  # the rate window moves on; totals stay
    assert p.calls_per_s() == 0.0 and p.tool_calls == 4
    p.stage_start(1)
    assert "rollouts 0 done / 0 in flight" in p.lines()[2]


async def test_instrument_counts_tool_calls_and_rewarded_rollouts() -> None:
    async def run(code: str) -> ToolOutcome:
        status = ToolStatus.ERROR if "raise" in code else ToolStatus.OK
        return ToolOutcome(status=status, output=code)

    async def reward(problem: Any, rollout: Any) -> float:
        return 1.0

    tool = FunctionTool(run, {"type": "function", "function": {"name": "py", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}}}})
    runner = types.SimpleNamespace(tools=[tool], reward_fn=reward)
    p = RunProgress("t", STAGES)
    instrument(runner, p)
    assert runner.tools[0].name == tool.name and runner.tools[0].schema == tool.schema
    assert (await runner.tools[0]({"code": "1"})).output == "1"
    await runner.tools[0]({"code": "raise"})
    assert await runner.reward_fn(None, None) == 1.0
    assert (p.tool_calls, p.tool_failed, p.sandbox_errors, p.done) == (2, 1, 0, 1)


def test_never_on_a_non_terminal() -> None:
    assert not should_show(True, io.StringIO())
    assert not should_show(False, types.SimpleNamespace(isatty=lambda: True))
    assert should_show(True, types.SimpleNamespace(isatty=lambda: True))
    with progress_display(RunProgress("t", STAGES), True) as shown:  # pytest's stderr: no TTY
        assert shown is False


def test_render_shows_the_lines_and_a_step_bar() -> None:
    from rich.console import Console

    p = RunProgress("tiny", STAGES)
    p.step(25, 0, loss=2.0)
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(p.render())
    lines = console.export_text().splitlines()
    assert lines[0] == p.lines()[0] and lines[2:] == p.lines()[1:]
    assert lines[1] == "━" * 40 + "  25%"


def test_steps_stages_and_evals_ask_for_a_redraw_counts_do_not() -> None:
    p = RunProgress("tiny", STAGES)
    redraws: list[int] = []
    p.on_change = lambda: redraws.append(p.stage_step)
    p.stage_start(0)
    p.step(1, 0, loss=1.0)
    p.rollout_done()
    p.tool_call(ToolStatus.OK)
    p.evaluated(0, 0.5)
    assert redraws == [0, 1, 1]
