"""Tasks written for other RL projects, run in asyncrl's loop.

Owns three small bridges:
- `function_tool(fn)`: a plain Python function (sync or async, type hints, a docstring) as a
  `Tool` with an OpenAI function schema derived from its signature — what OpenAI-style
  tool-calling stacks take (a verifiers `@vf.tool` method works unchanged).
- `from_environment(env, tokenizer=...)`: a verifiers 0.4 taskset (`verifiers.v1.Taskset`,
  class or instance) as asyncrl's `Task`: problems, its tools, and a reward that is verifiers'
  own `Task.score` (`asyncrl.envs.verifiers_v1`). An object you write yourself in the same
  shape as verifiers' old classic API (`dataset` rows of `question`/`prompt` and `answer`, a
  `rubric` with `funcs`/`weights`, optional `tools` and `system_prompt`) works too; a real
  classic verifiers environment (<= 0.3) is refused with a message, since its rubric is a
  `RubricGroup` whose functions take arguments (`parser`, a chat `State`) asyncrl does not
  build.
- `rubric_reward(funcs, weights)`: plain reward functions as one reward. Each takes any of
  `prompt`, `completion`, `answer`, `state`, `task`, `info` by keyword (or `**kwargs`) and
  returns a float, sync or async; the score is the weighted sum. Here `completion` is
  `[{"role": "assistant", "content": rollout.response_text}]` (the whole response as one
  message) and `state` is `{"rollout": rollout}`. A function that raises scores 0, is named
  in the rollout's `reward_errors`, and the others still count.

Does not own: running anything (`asyncrl.api`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.envs.functions import function_tool
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.rollout.agent import EnvHook
from asyncrl.rollout.runner import RewardFn
from asyncrl.rollout.tools import Tool

__all__ = ["Task", "from_environment", "function_tool", "rubric_reward"]

def _accepts(fn: Callable[..., Any]) -> tuple[bool, frozenset[str]]:
    params = inspect.signature(fn).parameters.values()
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return any_kw, frozenset(p.name for p in params)


def rubric_reward(funcs: Sequence[Callable[..., Any]],
                  weights: Sequence[float] | None = None) -> RewardFn:
    """verifiers-style reward functions as one asyncrl reward: the weighted sum of their
    scores (weights default to 1.0 each). Each function gets, by keyword, those of `prompt`,
    `completion`, `answer`, `state`, `task`, `info` it names (all of them if it takes
    `**kwargs`); sync or async. A function that raises scores 0 and is named in the
    rollout's `reward_errors`; the others still count (as verifiers' own rubrics do)."""
    ws = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(ws) != len(funcs):
        raise ValueError(f"rubric_reward: {len(funcs)} functions but {len(ws)} weights")
    shapes = [_accepts(f) for f in funcs]

    async def reward(problem: Problem, rollout: Rollout) -> RewardResult:
        available = {"prompt": problem.question,
                     "completion": [{"role": "assistant", "content": rollout.response_text}],
                     "answer": problem.answer, "state": {"rollout": rollout},
                     "task": problem.source, "info": {}}
        total = 0.0
        detail: dict[str, float] = {}
        errors: list[str] = []
        for fn, w, (any_kw, names) in zip(funcs, ws, shapes, strict=True):
            kwargs = available if any_kw else {k: v for k, v in available.items() if k in names}
            name = getattr(fn, "__name__", "reward")
            try:
                score = fn(**kwargs)
                if inspect.isawaitable(score):
                    score = await score
                value = float(score)
            except Exception as e:  # one broken function scores 0; the others still count
                errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
                value = 0.0
            detail[name] = value
            total += w * value
        return RewardResult(reward=total, status="ok", detail=detail, errors=errors)

    return reward


@dataclass(frozen=True)
class Task:
    """A task from another project, ready for `asyncrl.api.rollouts(problems, tools=...,
    reward_fn=..., system_prompt=...)`."""

    problems: list[Problem]
    tools: list[Tool]
    reward_fn: RewardFn
    system_prompt: str | None
    """The environment's system prompt (None: keep the policy's)."""
    env: EnvHook | None = None
    """A text environment's turn hook, for `rollouts(..., env=task.env)` (None: none)."""


def _question(row: dict[str, Any], i: int) -> str:
    if "question" in row:
        return str(row["question"])
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        if users:
            return str(users[-1])
    raise ValueError(f"dataset row {i} has neither a 'question' nor a user message in "
                     "'prompt'")


def _from_verifiers(env: Any, tokenizer: Any, size: int) -> Task:
    from asyncrl.envs.source import TaskContext, adapt

    src = adapt(env, type(env).__name__, {"size": size, "eval_size": 0}, 0, key="env")
    ctx = TaskContext(tokenizer=tokenizer)
    assert src.reward is not None and src.tools is not None
    return Task(problems=src.train + src.eval, tools=list(src.tools(ctx)),
                reward_fn=src.reward(ctx), system_prompt=src.system_prompt or None)


def from_environment(env: Any, *, tokenizer: Any = None, size: int = 0) -> Task:
    """An environment as a `Task`.

    A verifiers 0.4 taskset (`verifiers.v1.Taskset`, class or instance; `size` caps the tasks
    read, required for an infinite one): its tasks, its `@vf.tool`s, and verifiers' own
    `Task.score` as the reward (`tokenizer`: the policy's, to read the rollout's turns as
    messages; see `asyncrl.envs.verifiers_v1`). To train on one, name it in a curriculum
    instead (`data.train = "generator:module:MyTaskset"`, docs/recipe.md).

    Else an object of the classic shape written by hand: `env.dataset` (rows with `question`
    or a chat `prompt`, `answer`, optional `id`/`task`), `env.rubric` (`funcs` and `weights`,
    or `reward_funcs` and `reward_weights`), `env.tools` (plain functions, via
    `function_tool`; optional) and `env.system_prompt` (optional)."""
    classes = env.__mro__ if isinstance(env, type) else type(env).__mro__
    modules = [c.__module__ for c in classes]
    if any(m.startswith("verifiers.v1") for m in modules):
        return _from_verifiers(env, tokenizer, size)
    if any(m == "verifiers" or m.startswith("verifiers.") for m in modules):
        raise ValueError(f"{type(env).__name__} is a classic verifiers environment (verifiers "
                         "<= 0.3); asyncrl adapts verifiers >= 0.4 tasksets (verifiers.v1). "
                         "Its rubric is a RubricGroup whose functions need verifiers' own "
                         "parser and State: port the environment to verifiers.v1")
    rows: Iterable[dict[str, Any]] = env.dataset
    problems = [Problem(id=str(row.get("id", f"row-{i}")), question=_question(row, i),
                        answer=str(row.get("answer", "")), source=str(row.get("task", "")))
                for i, row in enumerate(rows)]
    rubric = env.rubric
    funcs = getattr(rubric, "funcs", None) or getattr(rubric, "reward_funcs", None)
    if not funcs:
        raise ValueError("the environment's rubric has no reward functions "
                         "(looked for rubric.funcs and rubric.reward_funcs)")
    weights = getattr(rubric, "weights", None) or getattr(rubric, "reward_weights", None)
    tools: list[Tool] = [t if isinstance(t, Tool) else function_tool(t)
                         for t in getattr(env, "tools", None) or ()]
    return Task(problems=problems, tools=tools, reward_fn=rubric_reward(funcs, weights),
                system_prompt=getattr(env, "system_prompt", None))
