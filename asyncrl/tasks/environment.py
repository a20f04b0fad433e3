"""`from_environment(env)`: an environment written for another RL project as a bound `Task`.

A verifiers 0.4 taskset (`verifiers.v1.Taskset`, class or instance) gives its tasks, its tools
and a reward that is verifiers' own `Task.score` (`asyncrl.tasks.bridges.verifiers`). An
object you write yourself in the same shape as verifiers' old classic API (`dataset` rows of
`question`/`prompt` and `answer`, a `rubric` with `funcs`/`weights`, optional `tools` and
`system_prompt`) works too; a real classic verifiers environment (<= 0.3) is refused with a
message, since its rubric is a `RubricGroup` whose functions take arguments (`parser`, a chat
`State`) asyncrl does not build.

Does not own: running anything (`asyncrl.api`). Sits above the bridges and `source` (it adapts
through `source.adapt`), so no bridge imports back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from asyncrl.records import Problem
from asyncrl.rollout.tools import Tool
from asyncrl.tasks.bridges.functions import function_tool
from asyncrl.tasks.rewards.rubric import rubric_reward
from asyncrl.tasks.source import adapt
from asyncrl.tasks.task import Task

__all__ = ["from_environment"]


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
    from asyncrl.tasks.task import TaskContext

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
    messages; see `asyncrl.tasks.bridges.verifiers`). To train on one, name it in a curriculum
    instead (`data.train = "generator:module:MyTaskset"`, docs/tasks.md).

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
