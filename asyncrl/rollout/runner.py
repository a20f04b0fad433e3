"""The group runner: 2G rollouts per prompt, scheduled on engines, rewarded, yielded per group.

Owns: `RolloutRunner` (what the train loop and eval call), one task per rollout, resuming a
rollout on another engine when its engine fails, calling the reward function, and collecting
finished rollouts into `records.Group`s. Does not own: turns (`agent`), admission
(`admission`/`scheduler`), RoC or training.

A group is yielded the moment its last rollout is rewarded; there is no barrier over the batch.
A rollout's failure (engine error, sandbox failure, reward error) is recorded on it and never
raised into its group; an engine that fails moves its rollouts to the others, resuming each
from its last completed turn (at most `max_requeues` times per rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from asyncrl import formats
from asyncrl.engine.base import Engine
from asyncrl.errors import EngineUnavailable
from asyncrl.log import bind_contextvars, get_logger
from asyncrl.records import Group, Problem, RewardResult, Rollout, RolloutStatus, StopReason
from asyncrl.rollout.admission import AdmissionPolicy, Ask
from asyncrl.rollout.agent import AgentLoop, EnvHook, RolloutSettings, env_error_text
from asyncrl.rollout.codec import Codec
from asyncrl.rollout.eventloop import quiet_gc
from asyncrl.rollout.scheduler import Lease, Scheduler
from asyncrl.rollout.tools import Tool

log = get_logger(__name__)

RewardFn = Callable[[Problem, Rollout], Awaitable[RewardResult]]
"""`async reward_fn(problem, rollout) -> RewardResult`."""

OnRollout = Callable[[Problem, Rollout], None]
"""`on_rollout(problem, rollout)`: called once per rollout the moment it is rewarded, on the
loop (keep it quick: hand the rollout to a queue, do not block)."""


class _GroupState:
    __slots__ = ("group_id", "n", "problem", "rollouts")

    def __init__(self, group_id: str, problem: Problem, n: int) -> None:
        self.group_id = group_id
        self.problem = problem
        self.n = n
        self.rollouts: list[Rollout | None] = [None] * n

    def add(self, k: int, ro: Rollout) -> Group | None:
        self.rollouts[k] = ro
        if any(r is None for r in self.rollouts):
            return None
        return Group(group_id=self.group_id, problem=self.problem,
                     rollouts=[r for r in self.rollouts if r is not None])


class RolloutRunner:
    """Runs rollouts for problems on engines and streams finished groups.

    `RolloutRunner(engines, tokenizer, tools, reward_fn, *, policy="kv", max_requeues=3,
    reward_timeout_s=60.0, load_timeout_s=10.0, system_prompt="", policy_options=None)`

    - `engines`: started engines (`Engine` protocol), opened by the caller.
    - `tools`: `Tool`s offered to the model (empty: plain chain-of-thought rollouts); their
      schemas go into the prompt.
    - `reward_fn`: `async (problem, rollout) -> RewardResult`; a raise scores 0 with status
      `reward_error`, the deadline `reward_timeout_s` gives `reward_timeout`.
    - `policy`: admission policy name (`"kv"`, `"least_requests"`, `"static"`) or instance;
      `policy_options` go to its constructor.
    - `env`: a text environment's turn hook (`agent.EnvHook`): it answers each assistant turn
      that ends without a tool call with an observation, or ends the episode.
    - `quiet_gc`: no routine automatic garbage collections while `run` is in flight, only a
      memory backstop (see `eventloop.quiet_gc`: with thousands of rollouts, a full
      collection stalls the loop for up to a second and young ones for tens of ms); one full
      collection when it ends.
    """

    def __init__(self, engines: Sequence[Engine], tokenizer: Any, tools: Sequence[Tool],
                 reward_fn: RewardFn, *, policy: str | AdmissionPolicy = "kv",
                 max_requeues: int = 3, reward_timeout_s: float = 60.0,
                 load_timeout_s: float = 10.0, system_prompt: str = "",
                 policy_options: dict[str, Any] | None = None,
                 quiet_gc: bool = True, env: EnvHook | None = None) -> None:
        if not engines:
            raise ValueError("RolloutRunner needs at least one engine")
        self.engines = list(engines)
        self.tokenizer = tokenizer
        self._codec = Codec.of(tokenizer)  # its decode table is built here, not on a run's loop
        self.tools = list(tools)
        self.reward_fn = reward_fn
        self.policy = policy
        self.policy_options = dict(policy_options or {})
        self.max_requeues = max_requeues
        self.reward_timeout_s = reward_timeout_s
        self.load_timeout_s = load_timeout_s
        self.system_prompt = system_prompt
        self.quiet_gc = quiet_gc
        self.env = env
        self._groups = itertools.count()
        self._carry: dict[str, Any] = {}
        self.last_scheduler: Scheduler | None = None
        """The scheduler of the latest `run` (its counters: admitted, requeues, failed_engines)."""

    def prompt_ids(self, problem: Problem, settings: RolloutSettings) -> list[int]:
        """The problem's prompt as the model sees it, tokenized."""
        return self._codec.encode(self._prompt_text(problem, settings))

    def _prompt_text(self, problem: Problem, settings: RolloutSettings) -> str:
        schemas = [t.schema for t in self.tools] or None
        return formats.render_prompt(problem.question, settings.tool_format, schemas,
                                     self.system_prompt)

    async def run(self, problems: Sequence[Problem], samples_per_prompt: int,
                  settings: RolloutSettings, policy_version: int = 0, *,
                  on_rollout: OnRollout | None = None) -> AsyncIterator[Group]:
        """Yield one `Group` per problem (its `samples_per_prompt` rollouts, rewarded), in
        completion order, each as soon as its last rollout is rewarded. `policy_version` only
        labels the rollouts (0 for inference); `on_rollout(problem, rollout)` sees each rollout
        as soon as it is rewarded, before its group is complete.

        Leaving the iteration early cancels the rollouts still running (use
        `contextlib.aclosing` to make that prompt).
        """
        if samples_per_prompt < 1:
            raise ValueError("samples_per_prompt must be >= 1")
        if not problems:
            return
        # What the admission policy learned last step (the kv reservation ratio) seeds this
        # step's; options given by the caller win.
        options = {**self._carry, **self.policy_options} if isinstance(self.policy, str) else {}
        gc_quiet = quiet_gc() if self.quiet_gc else contextlib.nullcontext()
        with gc_quiet:
            async with contextlib.aclosing(self._run(problems, samples_per_prompt, settings,
                                                     policy_version, options,
                                                     on_rollout)) as groups:
                async for group in groups:
                    yield group

    async def _run(self, problems: Sequence[Problem], samples_per_prompt: int,
                   settings: RolloutSettings, policy_version: int,
                   options: dict[str, Any],
                   on_rollout: OnRollout | None) -> AsyncGenerator[Group, None]:
        agent = AgentLoop(self.tokenizer, self.tools, settings, env=self.env)
        # Bounded by construction: at most one item per problem (or one crash) is ever put.
        done: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        # An explicit task set rather than a TaskGroup: this is an async generator, and a
        # TaskGroup must not stay open across `yield` (a consumer leaving early would surface
        # as an exception group). The set is cancelled and awaited in `finally`.
        tasks: set[asyncio.Task[None]] = set()

        def crashed(task: asyncio.Task[None]) -> None:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                done.put_nowait(exc)  # a bug in the runner itself: surface it

        async with Scheduler(self.engines, self.policy, load_timeout_s=self.load_timeout_s,
                             **options) as sched:
            self.last_scheduler = sched
            try:
                prompts = await self._codec.aencode_many(
                    [self._prompt_text(problem, settings) for problem in problems])
                for i, (problem, ids) in enumerate(zip(problems, prompts, strict=True)):
                    if i:
                        # Start groups one loop iteration apart: thousands of rollouts taking
                        # their first step in the same iteration would stall the loop.
                        await asyncio.sleep(0)
                    # Seeded settings: ids (and so each request's seed, `AgentLoop`) are a
                    # function of the call, so a rerun in a new process samples the same; the
                    # caller gives each call its own seed. Unseeded: a process-wide counter.
                    gid = (f"{problem.id}:v{policy_version}:s{settings.seed}:{i}"
                           if settings.seed is not None
                           else f"{problem.id}:v{policy_version}:{next(self._groups)}")
                    state = _GroupState(gid, problem, samples_per_prompt)
                    for k in range(samples_per_prompt):
                        task = asyncio.create_task(
                            self._rollout(sched, agent, state, k, ids, settings, policy_version,
                                          done, on_rollout), name=f"rollout-{gid}:{k}")
                        tasks.add(task)
                        task.add_done_callback(crashed)
                for _ in range(len(problems)):
                    item = await done.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if sched.policy is not None:
                    self._carry = sched.policy.carry_over()

    async def _rollout(self, sched: Scheduler, agent: AgentLoop, group: _GroupState, k: int,
                       prompt_ids: list[int], settings: RolloutSettings, policy_version: int,
                       done: asyncio.Queue[Group | BaseException],
                       on_rollout: OnRollout | None = None) -> None:
        ro = agent.new_rollout(prompt_ids, rollout_id=f"{group.group_id}:{k}",
                               prompt_id=group.problem.id, group_id=group.group_id,
                               policy_version=policy_version)
        # this task's own context (tasks copy it): every log line of this rollout carries these
        bind_contextvars(rollout_id=ro.rollout_id, policy_version=policy_version)
        t0 = time.perf_counter()
        try:
            await self._drive(sched, agent, ro, settings)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never raise into the group: record it on the rollout
            log.exception("rollout_runner_error", rollout_id=ro.rollout_id)
            agent.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=f"runner: {e!r}")
        ro.timing.total_s = time.perf_counter() - t0
        if ro.status == RolloutStatus.FAILED:  # returned with its reason, and said out loud
            log.warning("rollout_failed", rollout_id=ro.rollout_id, error=ro.error)
        await self._reward(group.problem, ro)
        if on_rollout is not None:
            on_rollout(group.problem, ro)
        finished = group.add(k, ro)
        if finished is not None:
            done.put_nowait(finished)

    async def _drive(self, sched: Scheduler, agent: AgentLoop, ro: Rollout,
                     settings: RolloutSettings) -> None:
        """Acquire an engine, run turns; on engine failure requeue and resume elsewhere."""
        attempts = 0
        while True:
            ask = Ask(rollout_id=ro.rollout_id,
                      context_tokens=len(ro.prompt_ids) + len(ro.response_ids),
                      remaining_tokens=max(0, settings.max_response_tokens - len(ro.response_ids)))
            tq = time.perf_counter()
            try:
                lease = await sched.acquire(ask, requeue=attempts > 0)
            except EngineUnavailable as e:
                agent.finish(ro, RolloutStatus.FAILED, StopReason.ERROR, error=f"no engine: {e}")
                return
            ro.timing.queued_s += time.perf_counter() - tq
            outcome = "cancelled"
            try:
                await agent.advance(ro, lease.engine, on_progress=self._progress_hook(sched, lease,
                                                                                      settings))
                outcome = "done"
            except EngineUnavailable as e:
                outcome = "requeue"
                sched.engine_failed(lease.engine_name, e)
                attempts += 1
                sched.requeues += 1
                log.info("rollout_requeued", rollout_id=ro.rollout_id, engine=lease.engine_name,
                         attempt=attempts, resume_tokens=len(ro.response_ids))
                if attempts > self.max_requeues:
                    outcome = "failed"
                    agent.finish(ro, RolloutStatus.FAILED, StopReason.ERROR,
                                 error=f"engine unavailable {attempts} times; last: {e}")
            finally:
                sched.release(lease)
            if outcome != "requeue":
                return

    @staticmethod
    def _progress_hook(sched: Scheduler, lease: Lease,
                       settings: RolloutSettings) -> Callable[[Rollout], None]:
        def hook(ro: Rollout) -> None:
            sched.progress(lease, len(ro.prompt_ids) + len(ro.response_ids),
                           max(0, settings.max_response_tokens - len(ro.response_ids)))
        return hook

    async def _reward(self, problem: Problem, ro: Rollout) -> None:
        try:
            async with asyncio.timeout(self.reward_timeout_s):
                res = await self.reward_fn(problem, ro)
            ro.reward, ro.reward_status, ro.answer = float(res.reward), res.status, res.answer
            ro.correct = res.correct
            if res.detail or res.errors:
                ro.reward_detail, ro.reward_errors = dict(res.detail), list(res.errors)
        except TimeoutError:
            log.warning("reward_timeout", rollout_id=ro.rollout_id,
                        timeout_s=self.reward_timeout_s)
            ro.reward, ro.reward_status = 0.0, "reward_timeout"
        except Exception as e:  # a broken reward scores 0 and is recorded; the group goes on
            # a text environment's fault reads the same as during a turn (`environment: `)
            error = env_error_text(e) if str(e).startswith("environment: ") else repr(e)
            log.warning("reward_error", rollout_id=ro.rollout_id, error=error[:300])
            ro.reward, ro.reward_status = 0.0, "reward_error"
            ro.reward_errors = [error[:300]]
