"""The scheduler: the thin async shell around an admission policy.

Owns: waiting for admission (`acquire` returns a `Lease` on an engine), releasing it, feeding
the policy turn progress and engine load reports, and taking failed engines out. Does not own:
the admission rules (`admission`, pure), running turns (`agent`), or groups (`runner`).

Event-driven, no polling: every state change (a submit, a release, a load report, an engine
failure) runs the policy's `admit` at once and wakes the admitted waiters. Load reports are
asked for when a turn ends or a rollout leaves an engine (at most one `load()` call in flight
per engine; a change meanwhile asks again when it returns), and only for policies that use
them. Every `load()` call has a deadline; an engine that misses it, or whose stream raised
`EngineUnavailable`, is taken out: its rollouts go back to the front of the queue and resume
from their last completed turn on another engine (the runner does the resuming). When no
engine is left, waiters get `EngineUnavailable`.

Use: `async with Scheduler(engines, "kv") as sched:` (reads each engine's KV capacity from
`load()` on entry; owns the load-report tasks, cancelled and awaited on exit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.engine.base import Engine
from asyncrl.errors import EngineUnavailable
from asyncrl.log import get_logger
from asyncrl.rollout.admission import AdmissionPolicy, Ask, make_policy

log = get_logger(__name__)


@dataclass
class Lease:
    """A rollout's hold on an engine, from admission to release."""

    rollout_id: str
    engine: Engine
    engine_name: str

    @property
    def revoked(self) -> bool:
        """Set when the engine was taken out while this lease was held."""
        return self._revoked

    _revoked: bool = False


class Scheduler:
    """`Scheduler(engines, policy="kv", *, capacities=None, load_timeout_s=10.0,
    **policy_options)`; `policy` is a name from `admission.POLICIES` or a policy instance.
    `capacities` (engine name -> KV tokens) skips asking the engines."""

    def __init__(self, engines: Sequence[Engine], policy: str | AdmissionPolicy = "kv", *,
                 capacities: Mapping[str, int] | None = None, load_timeout_s: float = 10.0,
                 **policy_options: Any) -> None:
        if not engines:
            raise ValueError("the scheduler needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.engines = {e.name: e for e in engines}
        self.load_timeout_s = load_timeout_s
        self._policy_spec = policy
        self._policy_options = policy_options
        self._capacities = dict(capacities) if capacities else None
        self.policy: AdmissionPolicy | None = policy if isinstance(policy, AdmissionPolicy) else None
        self._waiters: dict[str, asyncio.Future[str]] = {}
        self._leases: dict[str, Lease] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._refreshing: set[str] = set()
        self._dirty: set[str] = set()
        self.requeues = 0
        self.admitted = 0
        self.failed_engines: list[str] = []

    # ------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Scheduler:
        if self.policy is None:
            caps = self._capacities or await self._read_capacities()
            assert isinstance(self._policy_spec, str)
            self.policy = make_policy(self._policy_spec, caps, **self._policy_options)
            for name in self.engines:
                if name not in caps:
                    self._take_out(name, "no load report at start")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable("scheduler closed"))
        self._waiters.clear()

    async def _read_capacities(self) -> dict[str, int]:
        async def one(e: Engine) -> tuple[str, int | None]:
            try:
                async with asyncio.timeout(self.load_timeout_s):
                    return e.name, (await e.load()).kv_tokens_capacity
            except Exception as err:  # an engine that cannot report is not used; the run goes on
                log.warning("engine_load_failed", engine=e.name, error=repr(err))
                return e.name, None

        got = await asyncio.gather(*(one(e) for e in self.engines.values()))
        caps = {n: c for n, c in got if c is not None}
        if not caps:
            raise EngineUnavailable("no engine answered a load request")
        return caps

    # -------------------------------------------------------------------------- leases
    async def acquire(self, ask: Ask, *, requeue: bool = False) -> Lease:
        """Wait until the policy admits `ask`; `requeue=True` puts it at the queue's front
        (a rollout resuming after its engine failed). Raises `EngineUnavailable` when no engine
        is left."""
        policy = self._policy()
        if not policy.any_alive():
            raise EngineUnavailable("no engine available")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[ask.rollout_id] = fut
        policy.submit(ask, front=requeue)
        self._dispatch()
        try:
            name = await fut
        except asyncio.CancelledError:
            self._waiters.pop(ask.rollout_id, None)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                policy.release(ask.rollout_id)  # admitted just as we were cancelled
                self._dispatch()
            else:
                policy.cancel(ask.rollout_id)
            raise
        lease = Lease(ask.rollout_id, self.engines[name], name)
        self._leases[ask.rollout_id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        """The rollout left its engine: finished, failed, or going back to the queue. Admits
        whoever fits now."""
        self._leases.pop(lease.rollout_id, None)
        policy = self._policy()
        left = policy.release(lease.rollout_id)
        self._dispatch()
        if left is not None:
            self._refresh(left)

    def progress(self, lease: Lease, context_tokens: int, remaining_tokens: int) -> None:
        """A turn of the lease's rollout ended. Raises `EngineUnavailable` if the lease was
        revoked meanwhile, so the rollout moves at this turn boundary."""
        if lease.revoked:
            raise EngineUnavailable(f"{lease.engine_name} was taken out")
        self._policy().progress(lease.rollout_id, context_tokens, remaining_tokens)
        self._refresh(lease.engine_name)

    def engine_failed(self, name: str, error: BaseException | str) -> None:
        """An engine raised `EngineUnavailable` or stopped answering: take it out."""
        self._take_out(name, str(error))

    def revive(self, name: str) -> None:
        """Put a repaired engine back in service."""
        if name in self.failed_engines:
            self.failed_engines.remove(name)
        self._policy().engine_up(name)
        self._dispatch()

    # ------------------------------------------------------------------------ internals
    def _policy(self) -> AdmissionPolicy:
        if self.policy is None:
            raise RuntimeError("use `async with Scheduler(...)` before acquiring")
        return self.policy

    def _dispatch(self) -> None:
        policy = self._policy()
        for rid, name in policy.admit():
            fut = self._waiters.pop(rid, None)
            if fut is None or fut.done():  # its waiter is gone: give the slot back
                policy.release(rid)
                continue
            self.admitted += 1
            fut.set_result(name)
        if self._waiters and not policy.any_alive():
            for rid, fut in list(self._waiters.items()):
                policy.cancel(rid)
                if not fut.done():
                    fut.set_exception(EngineUnavailable("no engine available"))
            self._waiters.clear()

    def _take_out(self, name: str, why: str) -> None:
        policy = self._policy()
        if not policy.is_alive(name):
            return
        lost = policy.engine_down(name)
        self.failed_engines.append(name)
        for rid in lost:
            lease = self._leases.get(rid)
            if lease is not None:
                lease._revoked = True
        log.warning("engine_taken_out", engine=name, reason=why, rollouts_moved=len(lost),
                    engines_left=len(policy.alive()))
        self._dispatch()

    def _refresh(self, name: str) -> None:
        """Ask `name` for its load (coalesced: one call in flight per engine)."""
        policy = self._policy()
        if not policy.uses_reports or not policy.is_alive(name):
            return
        if name in self._refreshing:
            self._dirty.add(name)
            return
        self._refreshing.add(name)
        task = asyncio.get_running_loop().create_task(self._report(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, name: str) -> None:
        engine = self.engines[name]
        try:
            while True:
                self._dirty.discard(name)
                try:
                    async with asyncio.timeout(self.load_timeout_s):
                        load = await engine.load()
                except Exception as e:  # a load call that fails or times out: the engine is out
                    self._take_out(name, f"load report failed: {e!r}")
                    return
                self._policy().report(name, load.kv_tokens_used, load.kv_tokens_capacity,
                                    age_s=load.age_s)
                self._dispatch()
                if name not in self._dirty:
                    return
        finally:
            self._refreshing.discard(name)
