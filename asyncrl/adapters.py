"""Tasks written for other RL projects, run in asyncrl's loop.

Owns two small bridges, both duck-typed (no dependency on the projects they mirror):
- `function_tool(fn)`: a plain Python function (sync or async, type hints, a docstring) as a
  `Tool` with an OpenAI function schema derived from its signature — what OpenAI-style
  tool-calling stacks and `verifiers`' `ToolEnv(tools=[fn, ...])` take.
- `from_environment(env)`: a `verifiers`-style environment (an object with `dataset` rows of
  `question`/`prompt` and `answer`, a `rubric` of weighted reward functions, optional `tools`
  and `system_prompt`) as asyncrl's `Task`: problems, tools and one reward function.
  `rubric_reward(funcs, weights)` is that reward bridge on its own.

The verifiers conventions mirrored here (from its documentation, not its code): a reward
function takes any of `prompt`, `completion`, `answer`, `state`, `task`, `info` by keyword
(or `**kwargs`) and returns a float, sync or async; a chat `completion` is a list of messages
whose last one's `content` is the answer text; the rubric's score is the weighted sum. Here
`completion` is `[{"role": "assistant", "content": rollout.response_text}]` (the whole
response, tool calls and outputs included, as one message) and `state` is
`{"rollout": rollout}`. Does not own: running anything (`asyncrl.api`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.rollout.runner import RewardFn
from asyncrl.rollout.tools import FunctionTool, Tool

__all__ = ["Task", "from_environment", "function_tool", "rubric_reward"]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}
_REWARD_ARGS = ("prompt", "completion", "answer", "state", "task", "info")


def _schema(fn: Callable[..., Any], name: str | None, description: str | None) -> dict[str, Any]:
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        t = hints.get(pname, str)
        props[pname] = {"type": _JSON_TYPES.get(getattr(t, "__origin__", t), "string")}
        if param.default is param.empty:
            required.append(pname)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": name or fn.__name__,
        "description": description if description is not None else doc.split("\n\n")[0],
        "parameters": {"type": "object", "properties": props, "required": required}}}


def function_tool(fn: Callable[..., Any], *, name: str | None = None,
                  description: str | None = None, timeout_s: float = 30.0,
                  max_output_chars: int = 256) -> FunctionTool:
    """`fn` as a tool. Its schema comes from the signature (`int` -> integer, `float` ->
    number, `bool`, `str`, `list`, `dict`; other or missing hints -> string; parameters
    without a default are required) and the docstring's first paragraph. A sync `fn` runs on
    a worker thread so it cannot stall the loop; its return value is turned into text."""
    if asyncio.iscoroutinefunction(fn):
        call = fn
    else:
        async def call(**arguments: Any) -> str:
            return str(await asyncio.to_thread(fn, **arguments))
    return FunctionTool(call, _schema(fn, name, description), timeout_s=timeout_s,
                        max_output_chars=max_output_chars)


def _accepts(fn: Callable[..., Any]) -> tuple[bool, frozenset[str]]:
    params = inspect.signature(fn).parameters.values()
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return any_kw, frozenset(p.name for p in params)


def rubric_reward(funcs: Sequence[Callable[..., Any]],
                  weights: Sequence[float] | None = None) -> RewardFn:
    """verifiers-style reward functions as one asyncrl reward: the weighted sum of their
    scores (weights default to 1.0 each). Each function gets, by keyword, those of `prompt`,
    `completion`, `answer`, `state`, `task`, `info` it names (all of them if it takes
    `**kwargs`); sync or async. A function that raises makes the rollout's reward 0 with
    status `reward_error` (the runner records it and logs `reward_error`)."""
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
        for fn, w, (any_kw, names) in zip(funcs, ws, shapes, strict=True):
            kwargs = available if any_kw else {k: v for k, v in available.items() if k in names}
            score = fn(**kwargs)
            if inspect.isawaitable(score):
                score = await score
            total += w * float(score)
        return RewardResult(reward=total, status="ok")

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


def from_environment(env: Any) -> Task:
    """A verifiers-style environment as a `Task`: `env.dataset` (rows with `question` or a
    chat `prompt`, `answer`, optional `id`/`task`), `env.rubric` (`funcs` and `weights`, or
    `reward_funcs` and `reward_weights`), `env.tools` (plain functions, via
    `function_tool`; optional) and `env.system_prompt` (optional)."""
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
