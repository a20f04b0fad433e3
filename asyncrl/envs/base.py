"""The records of a task source: `TaskSource` (what a source gives a run) and `TaskContext`
(what a reward or tool factory may use). Imports nothing from the project but records."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.records import Problem

if TYPE_CHECKING:
    from asyncrl.rollout.runner import RewardFn
    from asyncrl.rollout.tools import Tool


@dataclass(frozen=True)
class TaskContext:
    """What a reward or tool factory may use. Built by the runtime; `None` where absent."""

    tokenizer: Any = None
    """The run's tokenizer (decodes a rollout's turns into messages)."""
    sandbox: Any = None
    """The Python tool's sandbox client (`sandbox.LocalSandboxClient` / `HttpSandboxClient`)."""
    reward_host: Any = None
    """The killable function host the math check runs in (`asyncrl.reward.FunctionHost`)."""
    time_limit_s: float = 4.0
    """The Python tool's time limit per call."""
    max_output_chars: int = 256
    """Cut of a tool's output as the model sees it."""


RewardFactory = Callable[[TaskContext], "RewardFn"]
ToolFactory = Callable[[TaskContext], "Sequence[Tool]"]


@dataclass(frozen=True)
class TaskSource:
    """What a task source gives a run."""

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
    """A text environment's turn hook factory (`asyncrl.envs.textenv`): it answers the
    model's turns with observations; None: turns end the rollout as usual."""
    solution_code: Callable[[Problem], str] | None = None
    """A program whose stdout is the problem's answer (SFT transcripts); None: the source
    cannot be used by an SFT stage that generates transcripts."""
    system_prompt: str = ""
    """The source's system text, used when `data.system_prompt` is empty."""
    close: Callable[[], None] | None = None
    """Releases what the source holds (an environment's processes); None: nothing."""
