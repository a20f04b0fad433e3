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
    eval_source: TaskSource | None = None
    """The task source `spec.eval` names when it is not `spec.train`'s; None otherwise. Its
    own reward and environment score the held-out problems (`bind`)."""

    @property
    def solution_code(self) -> Any:
        """The source's solution programs; for a problem file, a built-in family's by each
        problem's `source` (files written by `asyncrl data prepare` name theirs)."""
        if self.source is not None:
            return self.source.solution_code
        from asyncrl.tasks.families import solution_code

        return solution_code


def _split(spec: str, split: str, source: TaskSource | None) -> LoadResult:
    if source is None:
        return read_problem_file(spec)
    dropped = source.dropped if split == "train" else source.dropped_eval
    return LoadResult(list(source.train if split == "train" else source.eval),
                      dict(sorted(dropped.items())))


def load_task(spec: TaskSpec) -> LoadedTask:
    """Read each split of `spec` once: one task source serves both splits when both name it."""
    name = source_name(spec.train, "data.train")
    source = load_source(name, spec.options, spec.seed) if name is not None else None
    train = _split(spec.train, "train", source) if "train" in spec.splits else None
    evals = eval_source = None
    if spec.eval and "eval" in spec.splits:
        eval_source = source
        if spec.eval != spec.train:
            eval_name = source_name(spec.eval, "data.eval")
            eval_source = (load_source(eval_name, spec.options, spec.seed, key="data.eval")
                           if eval_name is not None else None)
        evals = _split(spec.eval, "eval", eval_source)
        eval_source = eval_source if eval_source is not source else None
    return LoadedTask(spec=spec, source=source, train=train, eval=evals,
                      eval_source=eval_source)


def bind(loaded: LoadedTask, ctx: TaskContext) -> Task:
    """The loaded task with its reward, tools and environment built over `ctx`. The held-out
    problems of a `data.eval` source other than `data.train`'s are scored by that source's own
    reward and environment (`split_routed`); the tools and system text are `data.train`'s."""
    spec, src = loaded.spec, loaded.source
    try:
        tools = build_tools(spec.tools, src, ctx) if spec.tools else []
        reward = build_reward(spec.reward, src, ctx)
        env = src.env(ctx) if src is not None and src.env is not None else None
        if loaded.eval_source is not None and loaded.eval is not None:
            reward, env = split_routed(loaded, ctx, reward, env)
    except BaseException:
        _close(src, loaded.eval_source)
        raise
    skipped = {k: r.skipped for k, r in (("train", loaded.train), ("eval", loaded.eval))
               if r is not None}
    return Task(problems=list(loaded.train.problems) if loaded.train is not None else [],
                held_out=list(loaded.eval.problems) if loaded.eval is not None else [],
                tools=tools, reward_fn=reward, env=env,
                system_prompt=(src.system_prompt or None) if src is not None else None,
                skipped=skipped, solution_code=loaded.solution_code,
                name=src.name if src is not None else spec.train,
                close=(lambda: _close(src, loaded.eval_source))
                if src is not None or loaded.eval_source is not None else None)


def eval_reward_spec(spec: str, train_source: TaskSource | None,
                     eval_source: TaskSource) -> str | None:
    """The reward the held-out split of a source other than `data.train`'s is scored with, as
    a `[task] reward` name; None: the training split's reward. `auto` is per split (the
    source's own check, else `math`); `source` takes the eval source's own when it has one; a
    named reward scores both splits."""
    if spec in ("auto", "source") and eval_source.reward is not None:
        return "source"
    if spec == "auto" and train_source is not None and train_source.reward is not None:
        return "math"
    return None


def split_routed(loaded: LoadedTask, ctx: TaskContext, reward: Any, env: Any
                 ) -> tuple[Any, Any]:
    """(reward, env) that score each held-out problem of `loaded.eval_source` with that
    source's own reward and environment, and every other problem as before. Problems are told
    apart by id, so an id in both splits is a `ConfigError`."""
    ev, spec = loaded.eval_source, loaded.spec
    assert ev is not None and loaded.eval is not None
    eval_ids = {p.id for p in loaded.eval.problems}
    shared = sorted(eval_ids & {p.id for p in (loaded.train.problems if loaded.train else [])})
    if shared:
        raise ConfigError("data.eval", f"problem id {shared[0]!r} is in both data.train and "
                          f"data.eval ({spec.eval}), whose sources score differently")
    which = eval_reward_spec(spec.reward, loaded.source, ev)
    eval_reward = reward if which is None else build_reward(which, ev, ctx)
    eval_env = ev.env(ctx) if ev.env is not None else None
    if eval_reward is reward and eval_env is None:
        return reward, env

    async def routed_reward(problem: Problem, rollout: Any) -> Any:
        fn = eval_reward if problem.id in eval_ids else reward
        return await fn(problem, rollout)

    async def routed_env(rollout: Any, text: str) -> str | None:
        hook = eval_env if rollout.prompt_id in eval_ids else env
        return None if hook is None else await hook(rollout, text)

    return routed_reward, (routed_env if eval_env is not None else env)


def _close(*sources: TaskSource | None) -> None:
    for src in sources:
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
