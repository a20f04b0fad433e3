"""Opening a task: what a run (or an embedding program) trains and evaluates on, loaded once.

Owns the one way a task is opened, used by the runtime and by `asyncrl.api.open_task`:
`load_task(spec)` reads the problems of each split once (a file, or the task source that
`generator:NAME` names: loaded once even when both splits name it) into a `LoadedTask`;
`bind(loaded, ctx)` builds its reward, tools and environment over a `TaskContext`;
`open_task(spec, ctx)` is the two together. The runtime loads first and binds after it has a
tokenizer, since a tokenizer built for a tiny run is trained on the loaded problems.
`reward_host_config()` is the function host the math check runs in, the same for both.

Does not own: what a source is (`source`), what the reward and tools are (`wiring`), prompt
filtering (`stream`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.errors import ConfigError
from asyncrl.log import get_logger
from asyncrl.records import Problem
from asyncrl.tasks.files import LoadResult, read_problem_file
from asyncrl.tasks.source import load_source, source_name
from asyncrl.tasks.task import Task, TaskContext, TaskSource
from asyncrl.tasks.wiring import build_reward, build_tools

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

log = get_logger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """What a task is opened from: the `[data]`, `[task]` and `run.seed` values that say it."""

    train: str
    """A problem file, or `generator:NAME`."""
    eval: str = ""
    """The held-out split's file or `generator:NAME`; empty: none."""
    options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    reward: str = "auto"
    tools: Sequence[str] = ("auto",)
    """`[task] tools`; empty: no tools (`rollout.tools = false`)."""
    splits: tuple[str, ...] = ("train", "eval")
    """The splits whose problems are read; a source named by `train` is loaded either way (its
    reward and tools score the run)."""

    @classmethod
    def of(cls, cfg: RunConfig, *, splits: tuple[str, ...] = ("train", "eval")) -> TaskSpec:
        return cls(train=cfg.data.train, eval=cfg.data.eval,
                   options=cfg.data.generator_options, seed=cfg.run.seed,
                   reward=cfg.task.reward, tools=tuple(cfg.task.tools) if cfg.rollout.tools
                   else (), splits=splits)


@dataclass(frozen=True)
class LoadedTask:
    """A task's problems, read once, and the source that scores them (unbound)."""

    spec: TaskSpec
    source: TaskSource | None
    """The task source `spec.train` names; None for a file."""
    train: LoadResult | None
    eval: LoadResult | None

    @property
    def solution_code(self) -> Any:
        """The source's solution programs; for a problem file, a built-in family's by each
        problem's `source` (files written by `asyncrl data prepare` name theirs)."""
        if self.source is not None:
            return self.source.solution_code
        from asyncrl.tasks.families import solution_code

        return solution_code


def _split(spec: str, split: str, source: TaskSource | None, options: Mapping[str, Any],
           seed: int) -> LoadResult:
    if source is None:
        name = source_name(spec, f"data.{split}")
        if name is None:
            return read_problem_file(spec)
        source = load_source(name, options, seed, key=f"data.{split}")
    dropped = source.dropped if split == "train" else source.dropped_eval
    return LoadResult(list(source.train if split == "train" else source.eval),
                      dict(sorted(dropped.items())))


def load_task(spec: TaskSpec) -> LoadedTask:
    """Read each split of `spec` once: one task source serves both splits when both name it."""
    name = source_name(spec.train, "data.train")
    source = load_source(name, spec.options, spec.seed) if name is not None else None
    train = (_split(spec.train, "train", source, spec.options, spec.seed)
             if "train" in spec.splits else None)
    evals = None
    if spec.eval and "eval" in spec.splits:
        evals = _split(spec.eval, "eval", source if spec.eval == spec.train else None,
                       spec.options, spec.seed)
    return LoadedTask(spec=spec, source=source, train=train, eval=evals)


def bind(loaded: LoadedTask, ctx: TaskContext) -> Task:
    """The loaded task with its reward, tools and environment built over `ctx`."""
    spec, src = loaded.spec, loaded.source
    try:
        tools = build_tools(spec.tools, src, ctx) if spec.tools else []
        reward = build_reward(spec.reward, src, ctx)
        env = src.env(ctx) if src is not None and src.env is not None else None
    except BaseException:
        _close(src)
        raise
    skipped = {k: r.skipped for k, r in (("train", loaded.train), ("eval", loaded.eval))
               if r is not None}
    return Task(problems=list(loaded.train.problems) if loaded.train is not None else [],
                held_out=list(loaded.eval.problems) if loaded.eval is not None else [],
                tools=tools, reward_fn=reward, env=env,
                system_prompt=(src.system_prompt or None) if src is not None else None,
                skipped=skipped, solution_code=loaded.solution_code,
                name=src.name if src is not None else spec.train,
                close=(lambda: _close(src)) if src is not None else None)


def _close(src: TaskSource | None) -> None:
    if src is not None and src.close is not None:
        src.close()


def open_task(spec: TaskSpec, ctx: TaskContext) -> Task:
    """`bind(load_task(spec), ctx)`: a task ready for rollouts. Call `task.close()` when done."""
    return bind(load_task(spec), ctx)


def one_split(task: Task, split: str) -> list[Problem]:
    """The problems of `split` of a task opened for both."""
    if split not in ("train", "eval"):
        raise ConfigError("split", f"split must be 'train' or 'eval', got {split!r}")
    return task.problems if split == "train" else task.held_out


def reward_host_config() -> Any:
    """The pool the math check runs in: one worker with `asyncrl` importable and math-verify
    preloaded (which the pool running model-written code must not have)."""
    from asyncrl.tasks.rewards.math import REWARD_PRELOAD, host_python_paths
    from sandbox import IsolationLevel, PoolConfig
    from sandbox.config import DEFAULT_PRELOAD

    return PoolConfig(workers=1, isolation=IsolationLevel.AUTO, light_preload=(),
                      preload=DEFAULT_PRELOAD + REWARD_PRELOAD,
                      python_paths=host_python_paths())
