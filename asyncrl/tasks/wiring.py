"""`[task] reward` and `[task] tools` made into the live reward function and tools of a run.

Owns `build_reward(spec, source, ctx)` and `build_tools(specs, source, ctx)`, the built-in
names (rewards `auto`, `math`, `exact_match`; tools `auto`, `python`, `source`) and how a
plugin object becomes a reward or a tool:

- a reward plugin is an async `(problem, rollout) -> RewardResult | float` (sync works too:
  it runs on a worker thread), or a factory `(ctx: TaskContext) -> such a function`
  (a callable taking one argument);
- a tool plugin is an `asyncrl.rollout.Tool`, a plain function (made a tool by
  `asyncrl.tasks.bridges.functions.function_tool`: its schema from the signature), or a list of those.

Does not own: what the reward or tools do (`asyncrl.tasks.rewards`, `asyncrl.rollout.tools`,
the bridges), or the checks `config check` runs (`asyncrl.tasks.check`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.errors import ConfigError
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.rollout.blocking import call_sync
from asyncrl.tasks.plugins import resolve
from asyncrl.tasks.task import TaskContext, TaskSource

if TYPE_CHECKING:
    from asyncrl.rollout.runner import RewardFn
    from asyncrl.rollout.tools import Tool


def _math(ctx: TaskContext) -> RewardFn:
    from asyncrl.tasks.rewards.math import MathReward

    if ctx.reward_host is None:
        raise ConfigError("task.reward", "the math reward needs a function host (a sandbox "
                          "pool); none was given")
    return MathReward(ctx.reward_host)


def _exact(ctx: TaskContext) -> RewardFn:
    from asyncrl.tasks.rewards.exact import exact_match_reward

    return exact_match_reward


BUILTIN_REWARDS: dict[str, Callable[[TaskContext], RewardFn]] = {
    "math": _math, "exact_match": _exact}
"""`math`: the final `\\boxed{}` answer equal to the problem's (`asyncrl.tasks.rewards.math.MathReward`:
exact for plain numbers, math-verify in a killable worker otherwise). `exact_match`: equal
after `asyncrl.api.normalize_answer`."""


REWARD_NAMES = ("auto", "source", *BUILTIN_REWARDS)
TOOL_NAMES = ("auto", "source", "python")


def _names(names: Sequence[str]) -> dict[str, Callable[[], Any]]:
    """Built-in names for `resolve`'s "did you mean" (handled before it is called)."""
    return {n: (lambda: None) for n in names}


def _one_param(fn: Callable[..., Any]) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def as_reward(fn: Callable[..., Any], name: str) -> RewardFn:
    """A plugin's `(problem, rollout) -> RewardResult | float` (sync or async) as a reward
    function the runner can call."""
    is_async = inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__))

    async def reward(problem: Problem, rollout: Rollout) -> RewardResult:
        out = await fn(problem, rollout) if is_async else await call_sync(
            fn, problem, rollout, what=f"reward {name!r}")
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, RewardResult):
            return out
        if isinstance(out, bool | int | float):
            return RewardResult(reward=float(out), status="ok")
        raise TypeError(f"reward {name!r} returned a {type(out).__name__}, not a "
                        "RewardResult or a number")

    return reward


def build_reward(spec: str, source: TaskSource | None, ctx: TaskContext) -> RewardFn:
    """The run's reward function from `[task] reward`."""
    if spec == "auto":
        if source is not None and source.reward is not None:
            return source.reward(ctx)
        return _math(ctx)
    if spec == "source":
        if source is None or source.reward is None:
            raise ConfigError("task.reward", "\"source\": the task source has no reward of its "
                              "own (data.train names no plugin source with one)")
        return source.reward(ctx)
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec](ctx)
    obj = resolve(spec, kind="rewards", key="task.reward", builtins=_names(REWARD_NAMES))
    if not callable(obj):
        raise ConfigError("task.reward", f"{spec!r} is a {type(obj).__name__}, not a function")
    if _one_param(obj):  # a factory given the context
        obj = obj(ctx)
        if not callable(obj):
            raise ConfigError("task.reward", f"{spec!r}(ctx) returned a "
                              f"{type(obj).__name__}, not a reward function")
    return as_reward(obj, spec)


def _python(ctx: TaskContext) -> list[Tool]:
    from asyncrl.rollout.tools import PythonTool

    if ctx.sandbox is None:
        raise ConfigError("task.tools", "the python tool needs a sandbox; none was given")
    return [PythonTool(ctx.sandbox, time_limit_s=ctx.time_limit_s,
                       max_output_chars=ctx.max_output_chars, show_time=ctx.show_time)]


def _as_tools(obj: Any, spec: str, ctx: TaskContext) -> list[Tool]:
    from asyncrl.rollout.tools import Tool
    from asyncrl.tasks.bridges.functions import function_tool

    items = list(obj) if isinstance(obj, list | tuple) else [obj]
    out: list[Tool] = []
    for item in items:
        if isinstance(item, Tool):
            out.append(item)
        elif callable(item):
            out.append(function_tool(item, max_output_chars=ctx.max_output_chars,
                                     timeout_s=ctx.tool_timeout_s))
        else:
            raise ConfigError("task.tools", f"{spec!r} gave a {type(item).__name__}, not a "
                              "tool or a function")
    return out


def source_tools(source: TaskSource, ctx: TaskContext) -> list[Tool]:
    """The task source's own tools; a raising `tools()` is a config error naming its key."""
    assert source.tools is not None
    try:
        return list(source.tools(ctx))
    except ConfigError:
        raise
    except Exception as e:  # a plugin's bug: say whose, at config time, not as a traceback
        raise ConfigError("task.tools", f"task source {source.name!r}: its tools() raised "
                          f"{type(e).__name__}: {e}") from e


def build_tools(specs: Sequence[str], source: TaskSource | None,
                ctx: TaskContext) -> list[Tool]:
    """The run's tools from `[task] tools`; names must be unique."""
    tools: list[Tool] = []
    for spec in specs:
        if spec == "auto":
            tools += (source_tools(source, ctx) if source is not None and source.tools is not None
                      else _python(ctx))
        elif spec == "source":
            if source is None or source.tools is None:
                raise ConfigError("task.tools", "\"source\": the task source has no tools of "
                                  "its own")
            tools += source_tools(source, ctx)
        elif spec == "python":
            tools += _python(ctx)
        else:
            tools += _as_tools(resolve(spec, kind="tools", key="task.tools", builtins=_names(TOOL_NAMES)),
                               spec, ctx)
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError("task.tools", f"two tools are named {dup[0]!r}")
    return tools


def system_text(configured: str, own: str | None, fmt: Any,
                schemas: list[dict[str, Any]] | None) -> str:
    """The system text a run's prompts use: `data.system_prompt` when set; else the task
    source's own (`own`, a verifiers task's), which with the built-in ChatML layout is followed
    by the format's own tool block (that layout's system text is the whole system message, so
    the tools would otherwise go unlisted); else empty (the format's default)."""
    if configured or not own:
        return configured
    if fmt._prompt is None and schemas:
        return f"{own}\n\n{fmt.system_prompt(schemas)}"
    return own
