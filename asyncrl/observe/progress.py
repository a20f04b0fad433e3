"""Live progress of a training run on a terminal.

Owns: `RunProgress`, a plain state object the train loop feeds (stage starts, steps, evals,
rollouts asked for) and that renders itself; the counting wrappers that feed it from the rollout
runner (`instrument`: each rewarded rollout, each tool call and its status); and
`progress_display`, the rich `Live` view of it on stderr.

The display is shown only when `logging.progress` is on *and* stderr is a terminal: never in a
pipe, a file or CI. While it is up, stderr goes through rich's proxy, so log lines keep
scrolling above the display (`asyncrl.log` writes to whatever `sys.stderr` is at each line).
Rich refreshes it from its own timer thread, which only reads the state's numbers.

Does not own: what is logged or written to `metrics.jsonl` (the train loop, `asyncrl.observe.metrics`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.records import ToolStatus

SANDBOX_FAULTS = frozenset({ToolStatus.SANDBOX_FAILURE, ToolStatus.TIMEOUT, ToolStatus.KILLED})
"""Tool outcomes shown as sandbox errors (the program did not get to finish); a program that
raised (`error`) or a malformed call count as failed calls only."""

BAR_WIDTH = 40
"""Characters of the stage's step bar."""

RATE_WINDOW_S = 30.0
"""Tool calls per second are counted over this trailing window."""


@dataclass(frozen=True)
class StagePlan:
    name: str
    kind: str
    """`sft` or `rl`."""
    steps: int

    @classmethod
    def of(cls, cfg: RunConfig) -> list[StagePlan]:
        """One plan per stage of a curriculum."""
        return [cls(st.name, st.kind, st.steps) for st in cfg.stages]


def _duration(s: float | None) -> str:
    if s is None:
        return "?"
    m, sec = divmod(round(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


class RunProgress:
    """What the display shows. Fed by the train loop; `lines()` / `render()` read it.

    `clock` is injectable so the ETA arithmetic is testable without waiting.
    """

    def __init__(self, run: str, stages: Sequence[StagePlan],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.stages = list(stages)
        self.clock = clock
        self.stage_index = 0
        self.stage_step = 0
        self._stage_t0 = clock()
        self._stage_first_step = 0
        self.step_s: dict[str, float] = {}
        """Seconds per step of each stage kind, measured this session."""
        self.loss: float | None = None
        self.reward: float | None = None
        self.eval_accuracy: float | None = None
        self.eval_step: int | None = None
        self.global_step = 0
        self.requested = 0
        self.done = 0
        self.tool_calls = 0
        self.tool_failed = 0
        self.sandbox_errors = 0
        self._call_times: deque[float] = deque()
        self.on_change: Callable[[], None] | None = None
        """Called after a stage start, a step or an eval (the display redraws then, so each
        step is shown even when steps are faster than its refresh rate); not after rollout
        or tool-call counts, which can come thousands of times a second."""

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --------------------------------------------------------------------------- feeding
    def stage_start(self, index: int, steps_done: int = 0) -> None:
        self.stage_index, self.stage_step = index, steps_done
        self._stage_t0, self._stage_first_step = self.clock(), steps_done
        self.requested = self.done = 0  # a stage's leftover waves are cancelled at its end
        self._changed()

    def step(self, stage_step: int, global_step: int, *, loss: float | None = None,
             reward: float | None = None) -> None:
        self.stage_step, self.global_step = stage_step, global_step
        if loss is not None:
            self.loss = loss
        if reward is not None:
            self.reward = reward
        n = stage_step - self._stage_first_step
        if n > 0:
            self.step_s[self._stage().kind] = (self.clock() - self._stage_t0) / n
        self._changed()

    def evaluated(self, global_step: int, accuracy: float) -> None:
        self.eval_step, self.eval_accuracy = global_step, accuracy
        self._changed()

    def rollouts_requested(self, n: int) -> None:
        self.requested += n

    def rollout_done(self) -> None:
        self.done += 1

    def tool_call(self, status: ToolStatus) -> None:
        now = self.clock()
        self.tool_calls += 1
        self.tool_failed += status != ToolStatus.OK
        self.sandbox_errors += status in SANDBOX_FAULTS
        self._call_times.append(now)

    # ---------------------------------------------------------------------------- reading
    def _stage(self) -> StagePlan:
        return self.stages[min(self.stage_index, len(self.stages) - 1)]

    def calls_per_s(self) -> float:
        now = self.clock()
        while self._call_times and self._call_times[0] < now - RATE_WINDOW_S:
            self._call_times.popleft()
        return len(self._call_times) / RATE_WINDOW_S

    def eta(self) -> tuple[float | None, float | None]:
        """(seconds left in this stage, in the run); None where no step time is known yet
        for a kind still to come. Evals and hard filters are not in the estimate."""
        st = self._stage()
        rate = self.step_s.get(st.kind)
        stage_left = None if rate is None else max(0, st.steps - self.stage_step) * rate
        run_left = stage_left
        for later in self.stages[self.stage_index + 1:]:
            r = self.step_s.get(later.kind)
            run_left = None if r is None or run_left is None else run_left + later.steps * r
        return stage_left, run_left

    def lines(self) -> list[str]:
        """The display as plain text lines (what `render` styles)."""
        st = self._stage()
        stage_left, run_left = self.eta()
        head = (f"{self.run}  stage {self.stage_index + 1}/{len(self.stages)} {st.name} "
                f"({st.kind})  step {self.stage_step}/{st.steps}  "
                f"ETA stage {_duration(stage_left)}, run {_duration(run_left)}")
        figure = (f"SFT loss {self.loss:.4f}" if st.kind != "rl" and self.loss is not None
                  else f"reward {self.reward:.3f}" if self.reward is not None else "reward -")
        acc = ("held-out accuracy -" if self.eval_accuracy is None else
               f"held-out accuracy {100 * self.eval_accuracy:.1f}% (step {self.eval_step})")
        in_flight = max(0, self.requested - self.done)
        failed = f"{100 * self.tool_failed / self.tool_calls:.0f}%" if self.tool_calls else "-"
        work = (f"rollouts {self.done} done / {in_flight} in flight  tool calls "
                f"{self.calls_per_s():.1f}/s ({self.tool_calls} total, {failed} failed)  "
                f"sandbox errors {self.sandbox_errors}")
        return [head, f"{figure}  {acc}", work]

    def render(self) -> Any:
        """The display: the text of `lines()`, the first with a bar of the stage's steps."""
        from rich.console import Group
        from rich.text import Text

        st = self._stage()
        head, figures, work = self.lines()
        done = min(self.stage_step, st.steps) / max(1, st.steps)
        filled = round(BAR_WIDTH * done)
        bar = Text.assemble(("━" * filled, "green"), ("━" * (BAR_WIDTH - filled), "grey30"),
                            f" {100 * done:3.0f}%")
        return Group(Text(head, style="bold"), bar, Text(figures), Text(work, style="dim"))


# ------------------------------------------------------------------------------- feeding
class _MeteredTool:
    """A `Tool` that counts each call's outcome into a `RunProgress`."""

    def __init__(self, tool: Any, progress: RunProgress) -> None:
        self._tool = tool
        self._progress = progress
        self.name: str = tool.name
        self.schema: dict[str, Any] = tool.schema

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        try:
            out = await self._tool(arguments)
        except Exception:  # counted as a failed call; the agent turns it into the tool's answer
            self._progress.tool_call(ToolStatus.MALFORMED)
            raise
        self._progress.tool_call(out.status)
        return out


def instrument(runner: Any, progress: RunProgress) -> None:
    """Make `runner` (a `RolloutRunner`) count into `progress`: every rewarded rollout and
    every tool call. Wraps its public `tools` and `reward_fn`; behaviour is unchanged."""
    runner.tools = [_MeteredTool(t, progress) for t in runner.tools]
    reward_fn: Callable[..., Awaitable[Any]] = runner.reward_fn

    async def counted(problem: Any, rollout: Any) -> Any:
        try:
            return await reward_fn(problem, rollout)
        finally:
            progress.rollout_done()

    runner.reward_fn = counted


def should_show(enabled: bool, stream: Any = None) -> bool:
    """The display is shown only when enabled and `stream` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


@contextlib.contextmanager
def progress_display(progress: RunProgress, enabled: bool) -> Iterator[bool]:
    """Show `progress` live on stderr while the block runs, if `should_show(enabled)`.
    Yields whether it is shown."""
    if not should_show(enabled):
        yield False
        return
    from rich.console import Console
    from rich.live import Live

    console = Console(file=sys.stderr)
    # stdout goes through the display only when it is the same terminal; a redirected stdout
    # (`asyncrl train ... > out.txt`) keeps its own destination
    with Live(console=console, get_renderable=progress.render, refresh_per_second=2,
              redirect_stdout=sys.stdout.isatty(), redirect_stderr=True,
              transient=False) as live:
        progress.on_change = live.refresh
        try:
            yield True
        finally:
            progress.on_change = None
