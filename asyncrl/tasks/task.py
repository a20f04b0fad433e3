"""The records of the task wing: `TaskSource` (a named source, unbound: its problems and the
factories of what it brings), `Task` (bound: problems, live tools, reward, environment), and
`TaskContext` (what a source's factories are given when it is bound). Imports nothing from the
project but records.

    source = load_source("tiny_math", {"train_size": 64}, seed=0)   # asyncrl.tasks.source
    task = bind(loaded, ctx)                                         # asyncrl.tasks.open
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.records import Problem

if TYPE_CHECKING:
    from asyncrl.rollout.agent import EnvHook
    from asyncrl.rollout.runner import RewardFn
    from asyncrl.rollout.tools import Tool


@dataclass(frozen=True)
class TaskContext:
    """What a reward or tool factory may use. Built where a task is bound; `None` where absent."""

    tokenizer: Any = None
    """The run's tokenizer (decodes a rollout's turns into messages)."""
    sandbox: Any = None
    """The Python tool's sandbox client (`sandbox.LocalSandboxClient` / `HttpSandboxClient`)."""
    reward_host: Any = None
    """The killable function host the math check runs in (`asyncrl.tasks.rewards.math`)."""
    time_limit_s: float = 4.0
    """The Python tool's time limit per call."""
    max_output_chars: int = 256
    """Cut of a tool's output as the model sees it."""
    tool_timeout_s: float = 30.0
    """The deadline of one call of an in-process tool (a plain function, a verifiers
    `@vf.tool`): a run's `rollout.tool_timeout_s`."""
    show_time: bool = True
    """Whether the Python tool's output shows its measured time (`rollout.tool_time`)."""


RewardFactory = Callable[[TaskContext], "RewardFn"]
ToolFactory = Callable[[TaskContext], "Sequence[Tool]"]
@dataclass(frozen=True)
class WorkedSolution:
    """How one problem is solved, for a cold start's transcripts: a few sentences of reasoning
    (what the steps are, in words) and a Python program whose stdout is the problem's answer.
    The transcript shows the reasoning, runs the program with the Python tool, and answers
    with what it printed."""

    program: str
    reasoning: str = ""
    """Sentences said before the call (empty: the transcript's own stock phrase)."""


SolutionCode = Callable[[Problem], "str | WorkedSolution | None"]
"""A problem's worked solution: a program (a str) whose stdout is the answer, a
`WorkedSolution`, or None when the source has none for this problem (the cold start gives it
no tool transcript, and counts it)."""


def worked_solution(value: str | WorkedSolution | None) -> WorkedSolution | None:
    """What a `SolutionCode` returned, as a `WorkedSolution` (a bare program has no reasoning);
    anything else is a `TypeError` naming what it got."""
    if value is None or isinstance(value, WorkedSolution):
        return value
    if isinstance(value, str):
        return WorkedSolution(program=value)
    raise TypeError(f"a solution must be a program (str), a WorkedSolution or None, got a "
                    f"{type(value).__name__}")


@dataclass(frozen=True)
class TaskSource:
    """What a task source gives a run, before it is bound to a tokenizer and a sandbox."""

    name: str
    train: list[Problem]
    eval: list[Problem]
    reward: RewardFactory | None = None
    """The source's own answer check (used by `[task] reward = "auto"`); None: the math
    reward."""
    tools: ToolFactory | None = None
    """The source's own tools (used by `[task] tools = ["auto"]` or `["source"]`)."""
    dropped: Mapping[str, int] = field(default_factory=dict)
    """Training items the source left out, by reason (`unanswerable`, `duplicate_question`,
    ...): reported with the data's skipped rows."""
    dropped_eval: Mapping[str, int] = field(default_factory=dict)
    """The same for the held-out split."""
    env: Callable[[TaskContext], Any] | None = None
    """A text environment's turn hook factory (`asyncrl.tasks.bridges.textenv`): it answers
    the model's turns with observations; None: turns end the rollout as usual."""
    solution_code: SolutionCode | None = None
    """Each problem's worked solution (`SolutionCode`: a program, a `WorkedSolution`, or None
    for a problem it has none for): what a cold start's generated transcripts show and run.
    None: the source cannot feed an SFT stage that generates tool transcripts."""
    system_prompt: str = ""
    """The source's system text, used when `data.system_prompt` is empty."""
    close: Callable[[], None] | None = None
    """Releases what the source holds (an environment's processes); None: nothing. Called
    when the task bound from it closes."""
    probe: Callable[[], None] | None = None
    """A cheap trial `config check` and the dry run make of the source's own code (a text
    environment: one built and closed), raising what a run would hit; None: none."""


@dataclass(frozen=True)
class Task:
    """A task bound for rollouts: `asyncrl.api.rollouts(task.problems, tools=task.tools,
    reward_fn=task.reward_fn, system_prompt=task.system_prompt, env=task.env)`, or a run's
    (`asyncrl.runtime.Runtime.task`), opened once and held for the run's lifetime."""

    problems: list[Problem]
    """The problems the task was opened for: a run's training split, or the split
    `asyncrl.api.open_task` was asked for."""
    tools: list[Tool]
    reward_fn: RewardFn
    system_prompt: str | None
    """The source's own system prompt (None: keep the policy's, or `data.system_prompt`)."""
    env: EnvHook | None = None
    """A text environment's turn hook, for `rollouts(..., env=task.env)` (None: none)."""
    held_out: list[Problem] = field(default_factory=list)
    """A run's evaluation split (`data.eval`); empty for a task opened for one split."""
    skipped: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Rows or items left out of each split (`"train"`, `"eval"`), by reason."""
    solution_code: SolutionCode | None = None
    """The source's worked solutions, for a cold start (None: it supplies none)."""
    name: str = ""
    """What the task was opened from (`tiny_math`, a file path, `module:attr`)."""
    close: Callable[[], None] | None = None
    """Releases what the source holds; the runtime and `open_task` call it on exit."""
