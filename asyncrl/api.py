"""The embedding API: run a trained model with tools and a reward from another project.

Owns the one documented face (docs/embedding.md is its reference):
- `load_policy(path)` -> `Policy`: a model or run directory with its curriculum's prompt,
  template, tool format and budgets; `policy.engine()` builds an in-process engine whose KV
  capacity is checked against the budget.
- `rollouts(...)`: every rollout streamed the moment it is rewarded; `rollout_groups(...)`:
  the same, one group per problem.
- `local_sandbox(...)` / `remote_sandbox(...)`: the Python tool over a sandbox pool in this
  process or over `sandbox serve` nodes.
- `open_task(source, ...)`: a task named the way a curriculum names it (`tiny_math`,
  `reasoning_gym`, a verifiers taskset `module:attr`, ...) with the reward and tools `[task]`
  would give it, opened the way a run opens it (`asyncrl.tasks.open`).
- `Task`, `from_environment`, `function_tool`, `rubric_reward` (`asyncrl.tasks`): tasks and
  tools written for other projects.
- `exact_match_reward`, `run_loop`, and the records and tools those take and give.

Does not own: the machinery (`asyncrl.rollout`, `asyncrl.engine`, `sandbox`); this module
wires it, fills coherent defaults (end-of-sequence is always a stop; a budget that cannot fit
an engine is a `BudgetError` before anything runs) and says what went wrong: a rollout that
cannot run comes back with status `failed` and its `error`, and is logged. Imports no torch.

    policy = load_policy("runs/tiny")
    async with policy.engine() as engine, local_sandbox() as python:
        async for ro in rollouts(problems, engines=[engine], policy=policy, tools=[python]):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

from asyncrl.engine.base import Engine
from asyncrl.errors import BudgetError, EngineUnavailable, ModelError
from asyncrl.log import get_logger
from asyncrl.policy import Policy, check_budget, load_policy, stop_ids, with_stops
from asyncrl.records import Group, Problem, RewardResult, Rollout, RolloutStatus, StopReason
from asyncrl.rollout.agent import EnvHook, RolloutSettings
from asyncrl.rollout.eventloop import run as run_loop
from asyncrl.rollout.runner import RewardFn, RolloutRunner
from asyncrl.rollout.tools import FunctionTool, PythonTool, Tool, ToolOutcome
from asyncrl.tasks.bridges.functions import function_tool
from asyncrl.tasks.environment import from_environment
from asyncrl.tasks.rewards.exact import exact_match_reward, normalize_answer
from asyncrl.tasks.rewards.rubric import rubric_reward
from asyncrl.tasks.task import Task

__all__ = [
    "BudgetError",
    "FunctionTool",
    "Group",
    "ModelError",
    "Policy",
    "Problem",
    "PythonTool",
    "RewardFn",
    "RewardResult",
    "Rollout",
    "RolloutSettings",
    "RolloutStatus",
    "StopReason",
    "Task",
    "Tool",
    "ToolOutcome",
    "exact_match_reward",
    "from_environment",
    "function_tool",
    "load_policy",
    "local_sandbox",
    "normalize_answer",
    "open_task",
    "remote_sandbox",
    "rollout_groups",
    "rollouts",
    "rubric_reward",
    "run_loop",
    "stop_ids",
]

log = get_logger(__name__)

LOAD_TIMEOUT_S = 10.0
"""Deadline on each engine's `load()` when the budget is checked."""


async def _prepare(problems: Sequence[Problem], engines: Sequence[Engine],
                   policy: Policy | None, tokenizer: Any, tools: Sequence[Tool],
                   reward_fn: RewardFn, settings: RolloutSettings | None,
                   system_prompt: str | None, admission: str, env: EnvHook | None = None
                   ) -> tuple[RolloutRunner, RolloutSettings]:
    """The runner and the settings to run with, after the budget check."""
    if tokenizer is None:
        if policy is None:
            raise TypeError("rollouts needs policy= (from load_policy) or tokenizer=")
        tokenizer = policy.tokenizer
    if settings is None:
        settings = policy.settings if policy is not None else RolloutSettings()
    settings = with_stops(settings, tokenizer)
    if system_prompt is None:
        system_prompt = policy.system_prompt if policy is not None else ""
    fmt = settings.tool_format
    why = fmt.uncallable([t.name for t in tools])
    if why:
        raise ValueError(f"{why}: use settings.tool_format = formats.HERMES for tools of "
                         "your own")
    if tools and system_prompt and fmt.name == "hermes" and fmt._prompt is None and not any(
            t.name in system_prompt for t in tools):
        # the built-in formats' system_prompt replaces their whole system text (that is what a
        # curriculum trains on), so the model would not be told about these tools
        log.warning("tools_not_in_system_prompt", tools=[t.name for t in tools],
                    format=fmt.name, hint="system_prompt replaces the format's system text, "
                    "tool list included: describe the tools in it, or leave it unset")
    runner = RolloutRunner(engines, tokenizer, tools, reward_fn, policy=admission,
                           system_prompt=system_prompt, env=env)
    if problems:
        longest = max(len(runner.prompt_ids(p, settings)) for p in problems)
        for engine in engines:
            try:
                async with asyncio.timeout(LOAD_TIMEOUT_S):
                    capacity = (await engine.load()).kv_tokens_capacity
            except TimeoutError:
                raise EngineUnavailable(f"engine {engine.name!r} did not report its KV capacity "
                                        f"within {LOAD_TIMEOUT_S:g}s") from None
            check_budget(capacity, settings.max_response_tokens, longest, engine.name)
    return runner, settings


async def rollouts(problems: Sequence[Problem], *, engines: Sequence[Engine],
                   policy: Policy | None = None, tokenizer: Any = None,
                   tools: Sequence[Tool] = (), reward_fn: RewardFn = exact_match_reward,
                   samples_per_prompt: int = 1, settings: RolloutSettings | None = None,
                   system_prompt: str | None = None, admission: str = "kv",
                   env: EnvHook | None = None) -> AsyncIterator[Rollout]:
    """Every rollout of `problems` (`samples_per_prompt` each), rewarded, in the order they
    finish. `rollout.prompt_id` is its problem's `id`.

    `policy` supplies the tokenizer, system prompt and settings; without one pass `tokenizer`
    (and `settings`, `system_prompt` as needed). The tokenizer's end-of-sequence ids are
    always stop ids. Raises `BudgetError` before anything runs when the longest prompt plus
    `settings.max_response_tokens` exceeds an engine's KV capacity. A rollout that fails
    (engine error, no engine left) is yielded with status `failed` and `error`, and logged as
    `rollout_failed`; a reward function that raises scores 0 with `reward_status`
    `reward_error`. `env`: a text environment's turn hook (`asyncrl.tasks.bridges.textenv`; what
    `open_task` gives as `task.env`). Leaving the loop early cancels the rollouts still
    running.
    """
    runner, settings = await _prepare(problems, engines, policy, tokenizer, tools, reward_fn,
                                      settings, system_prompt, admission, env)
    done: asyncio.Queue[Rollout | BaseException | None] = asyncio.Queue()

    async def drive() -> None:
        try:
            async for _ in runner.run(problems, samples_per_prompt, settings,
                                      on_rollout=lambda _p, ro: done.put_nowait(ro)):
                pass
        except Exception as e:  # handed to the consumer, who raises it
            done.put_nowait(e)
        else:
            done.put_nowait(None)

    task = asyncio.create_task(drive(), name="asyncrl-rollouts")
    try:
        while (item := await done.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def rollout_groups(problems: Sequence[Problem], *, engines: Sequence[Engine],
                         policy: Policy | None = None, tokenizer: Any = None,
                         tools: Sequence[Tool] = (), reward_fn: RewardFn = exact_match_reward,
                         samples_per_prompt: int = 2, settings: RolloutSettings | None = None,
                         system_prompt: str | None = None, admission: str = "kv",
                         env: EnvHook | None = None) -> AsyncIterator[Group]:
    """As `rollouts`, one `Group` per problem (its `samples_per_prompt` rollouts), each the
    moment its last rollout is rewarded: what GRPO needs."""
    runner, settings = await _prepare(problems, engines, policy, tokenizer, tools, reward_fn,
                                      settings, system_prompt, admission, env)
    run = cast(AsyncGenerator[Group, None], runner.run(problems, samples_per_prompt, settings))
    async with contextlib.aclosing(run) as groups:  # leaving early cancels what still runs
        async for group in groups:
            yield group


@contextlib.asynccontextmanager
async def local_sandbox(*, workers: int = 2, time_limit_s: float = 4.0,
                        memory_mb: int = 1024, isolation: str = "auto",
                        max_output_chars: int = 256) -> AsyncIterator[PythonTool]:
    """The Python tool over a sandbox pool started in this process (`sandbox.SandboxPool`),
    closed on exit. `isolation`: `auto` (the strongest available), `jail+seccomp`, `seccomp`
    or `none`; a level that cannot be had raises `sandbox.IsolationUnavailable`. The tool's
    `client.isolation` says which level is in force."""
    from sandbox import IsolationLevel, LocalSandboxClient, PoolConfig

    cfg = PoolConfig(workers=workers, time_limit_s=time_limit_s, memory_mb=memory_mb,
                     isolation=IsolationLevel(isolation))
    async with LocalSandboxClient(cfg) as client:
        yield PythonTool(client, time_limit_s=time_limit_s, max_output_chars=max_output_chars)


@contextlib.asynccontextmanager
async def remote_sandbox(urls: Sequence[str], *, token: str | None = None,
                         time_limit_s: float = 4.0, max_output_chars: int = 256,
                         call_timeout_s: float = 120.0) -> AsyncIterator[PythonTool]:
    """The Python tool over `sandbox serve` nodes (`sandbox.HttpSandboxClient`: batched,
    spread over the nodes, moved to another node when one fails or goes silent). `token`: the nodes' shared
    bearer token (required by a node bound off loopback); a wrong one raises
    `sandbox.AuthError` on entry."""
    from sandbox import HttpSandboxClient

    async with HttpSandboxClient(list(urls), token=token,
                                 call_timeout_s=call_timeout_s) as client:
        yield PythonTool(client, time_limit_s=time_limit_s, max_output_chars=max_output_chars)


@contextlib.asynccontextmanager
async def open_task(source: str, *, options: dict[str, Any] | None = None, seed: int = 0,
                    split: str = "eval", reward: str = "auto",
                    tools: Sequence[str] = ("auto",), tokenizer: Any = None,
                    sandbox_workers: int = 2, time_limit_s: float = 4.0,
                    max_output_chars: int = 256) -> AsyncIterator[Task]:
    """A task named as a curriculum names it, ready for `rollouts`: a `Task` (problems of
    `split`, tools, reward function), opened as a run opens it (`asyncrl.tasks.open`).

    `source` is what follows `generator:` in `data.train` (a built-in family such as
    `tiny_math` or `reasoning_gym`, a plugin `module:attr`, an entry point); `options` are
    its `data.generator_options`; `reward` and `tools` take the names of `[task] reward` and
    `[task] tools`. A sandbox pool (for the Python tool) and a function host (for the math
    check) run while the context is open. `tokenizer`: needed by sources whose reward reads
    the rollout's turns as messages (verifiers).
    """
    import dataclasses

    from asyncrl.tasks.open import TaskSpec, bind, load_task, one_split, reward_host_config
    from asyncrl.tasks.source import named
    from asyncrl.tasks.task import TaskContext
    from sandbox import LocalSandboxClient, PoolConfig, SandboxPool

    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    spec = named(source)
    loaded = load_task(TaskSpec(train=spec, eval=spec, options=options or {}, seed=seed,
                                reward=reward, tools=tuple(tools), splits=(split,)))
    tool_cfg = PoolConfig(workers=sandbox_workers, time_limit_s=time_limit_s)
    async with SandboxPool(reward_host_config()) as host, LocalSandboxClient(tool_cfg) as client:
        ctx = TaskContext(tokenizer=tokenizer, sandbox=client, reward_host=host,
                          time_limit_s=time_limit_s, max_output_chars=max_output_chars)
        task = bind(loaded, ctx)
        try:
            yield dataclasses.replace(task, problems=one_split(task, split), held_out=[])
        finally:
            if task.close is not None:
                task.close()
