"""Admission policy: which queued rollout starts on which engine, and when.

A pure state machine: it owns no tasks, engines or clocks, and is driven by calls (`submit`,
`admit`, `progress`, `release`, `report`, `engine_down`), so it is tested with no event loop
and reused as-is by the scheduler simulation in `bench/`. The async shell around it is
`scheduler.Scheduler`.

Vocabulary. A rollout asks with its context size (prompt + response so far) and its remaining
response budget. Its *reservation* on an engine is `context + ratio * remaining` KV tokens; an
engine *fits* a reservation when its estimated KV use plus the reservation is within its
capacity, or when it runs nothing at all (a lone rollout always gets to run, so nothing can
wait forever). Admission is strict FIFO over one global queue: when the head fits nowhere,
nothing behind it overtakes it (no starvation); rollouts requeued after an engine failure go
to the front. A rollout admitted to an engine keeps it for every later turn (prefix cache),
until it is released.

Policies (`POLICIES`, chosen by name):
- `kv` (the rStar2-Agent scheduler): the engine with the most free KV takes the head. The
  reservation ratio starts at `initial_ratio` (1.0: the worst case of docs/architecture.md) and is steered
  by the KV use engines report: while rollouts are queued and the engines' mean utilisation is
  below `target`, it decays (over-reservation must not leave KV idle); when any engine reports
  more than `high`, it is raised at once (that engine is about to preempt). One ratio serves all
  engines, so "most free" compares like with like. The estimate of an engine's use is also
  floored by its last report (adjusted by admissions and releases since), so an under-estimate
  is corrected at the next report; a real engine preempts if it ever overflows.
  Reports carry their age (a server refreshes its load numbers only every few decode steps,
  SGLang's `/v1/loads` every 15): a report older than `max_report_age_s` may have missed the
  rollouts admitted or finished since it was taken, so it can raise the floor and the ratio
  but never lower them.
- `least_requests`: the engine running the fewest rollouts takes the head, worst-case
  reservations (ratio 1, no correction).
- `static`: the baseline fixed split: the i-th submitted rollout belongs to engine i mod N, each
  engine admits its own FIFO with worst-case reservations; rollouts of a failed engine are
  dealt round-robin to the others.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout asking to run (first time, or again after its engine failed)."""

    rollout_id: str
    context_tokens: int
    """Prompt + response tokens so far (KV the engine must hold to resume it)."""
    remaining_tokens: int
    """Response budget still unspent."""


@dataclass
class _Running:
    ctx: int
    rem: int


@dataclass
class _Engine:
    name: str
    capacity: int
    alive: bool = True
    rollouts: dict[str, _Running] = field(default_factory=dict)
    sum_ctx: int = 0
    sum_rem: int = 0
    floor: float | None = None
    """Reported KV use, adjusted by admissions/releases since the report (None: no report)."""
    queue: collections.deque[Ask] = field(default_factory=collections.deque)
    """Per-engine queue (static policy only)."""


class AdmissionPolicy:
    """Common bookkeeping; subclasses choose the engine and the reservation ratio."""

    kind = "base"
    uses_reports = False
    """Whether reported KV use floors the estimate (the `kv` policy's correction)."""

    def __init__(self, capacities: Mapping[str, int]) -> None:
        if not capacities:
            raise ValueError("an admission policy needs at least one engine")
        self._engines = {n: _Engine(n, int(c)) for n, c in capacities.items()}
        self._n_alive = len(self._engines)
        self._queue: collections.deque[Ask] = collections.deque()
        self._where: dict[str, str] = {}
        self._ratio = 1.0

    # ------------------------------------------------------------------------- views
    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def alive(self) -> list[str]:
        return [e.name for e in self._engines.values() if e.alive]

    def any_alive(self) -> bool:
        return self._n_alive > 0

    def is_alive(self, engine: str) -> bool:
        e = self._engines.get(engine)
        return e is not None and e.alive

    def capacity(self, engine: str) -> int:
        return self._engines[engine].capacity

    def running(self, engine: str) -> list[str]:
        return list(self._engines[engine].rollouts)

    def where(self, rollout_id: str) -> str | None:
        """The engine a rollout runs on, or None (queued, released, or never seen)."""
        return self._where.get(rollout_id)

    def queued(self) -> list[str]:
        return [a.rollout_id for a in self._all_queued()]

    def ratio(self) -> float:
        """Fraction of a rollout's remaining budget that its reservation holds (1.0 = worst
        case). One ratio for every engine, so "most free" compares like with like."""
        return self._ratio

    def estimate(self, engine: str) -> float:
        """Estimated KV use of an engine, in tokens."""
        e = self._engines[engine]
        est = e.sum_ctx + self._ratio * e.sum_rem
        return est if e.floor is None else max(est, e.floor)

    def reservation(self, ask: Ask) -> float:
        """KV tokens `ask` reserves on whichever engine admits it."""
        return ask.context_tokens + self._ratio * ask.remaining_tokens

    def carry_over(self) -> dict[str, object]:
        """Constructor options that hand what this policy learned to the next step's policy
        (the runner makes one policy per step)."""
        return {}

    def free(self, engine: str) -> float:
        return self._engines[engine].capacity - self.estimate(engine)

    # ---------------------------------------------------------------------- commands
    def submit(self, ask: Ask, *, front: bool = False) -> None:
        """Queue a rollout (`front=True` for one requeued after a failure)."""
        if ask.rollout_id in self._where:
            raise ValueError(f"rollout {ask.rollout_id} is already running")
        self._enqueue(ask, front)

    def cancel(self, rollout_id: str) -> bool:
        """Drop a queued rollout (its waiter went away). False if it was not queued."""
        for q in self._queues():
            for a in q:
                if a.rollout_id == rollout_id:
                    q.remove(a)
                    return True
        return False

    def admit(self) -> list[tuple[str, str]]:
        """Admit every rollout that fits now, in queue order: `[(rollout_id, engine), ...]`."""
        out: list[tuple[str, str]] = []
        q = self._queue
        while q:
            ask = q[0]
            e = self._choose(ask)
            if e is None:
                break
            q.popleft()
            self._start(ask, e)
            out.append((ask.rollout_id, e.name))
        return out

    def progress(self, rollout_id: str, context_tokens: int, remaining_tokens: int) -> None:
        """A turn of a running rollout ended: its context and remaining budget now."""
        name = self._where.get(rollout_id)
        if name is None:
            return
        e = self._engines[name]
        r = e.rollouts[rollout_id]
        e.sum_ctx += context_tokens - r.ctx
        e.sum_rem += remaining_tokens - r.rem
        r.ctx, r.rem = context_tokens, remaining_tokens

    def release(self, rollout_id: str) -> str | None:
        """A rollout left its engine: finished, failed, or about to be resubmitted. Unknown or
        already released ids are ignored. Returns the engine."""
        name = self._where.pop(rollout_id, None)
        if name is None:
            return None
        e = self._engines[name]
        r = e.rollouts.pop(rollout_id)
        e.sum_ctx -= r.ctx
        e.sum_rem -= r.rem
        if e.floor is not None:
            e.floor = max(0.0, e.floor - r.ctx)
        return name

    max_report_age_s = float("inf")
    """Reports older than this are stale: they may raise the floor, never lower it."""

    def report(self, engine: str, kv_tokens_used: int, kv_tokens_capacity: int | None = None,
               age_s: float = 0.0) -> None:
        """Load reported by an engine: its KV use `age_s` seconds ago (and capacity, if it
        changed). Only policies with `uses_reports` floor their estimate with it."""
        e = self._engines.get(engine)
        if e is None:
            return
        if kv_tokens_capacity:
            e.capacity = int(kv_tokens_capacity)
        if self.uses_reports:
            if age_s > self.max_report_age_s and e.floor is not None:
                e.floor = max(e.floor, float(kv_tokens_used))
            else:
                e.floor = float(kv_tokens_used)

    def engine_down(self, engine: str) -> list[str]:
        """Mark an engine failed; returns the rollouts that ran on it (released here; their
        owners resubmit them with `submit(..., front=True)`)."""
        e = self._engines[engine]
        if e.alive:
            self._n_alive -= 1
        e.alive = False
        lost = list(e.rollouts)
        for rid in lost:
            self._where.pop(rid, None)
        e.rollouts.clear()
        e.sum_ctx = e.sum_rem = 0
        e.floor = None
        self._orphan_queue(e)
        return lost

    def engine_up(self, engine: str) -> None:
        e = self._engines[engine]
        if not e.alive:
            self._n_alive += 1
        e.alive = True
        e.floor = None

    # ------------------------------------------------------------------- for subclasses
    def _choose(self, ask: Ask) -> _Engine | None:
        raise NotImplementedError

    def _fits(self, e: _Engine, ask: Ask) -> bool:
        if not e.alive:
            return False
        if not e.rollouts:
            return True
        return self.estimate(e.name) + self.reservation(ask) <= e.capacity

    def _start(self, ask: Ask, e: _Engine) -> None:
        e.rollouts[ask.rollout_id] = _Running(ask.context_tokens, ask.remaining_tokens)
        e.sum_ctx += ask.context_tokens
        e.sum_rem += ask.remaining_tokens
        if e.floor is not None:
            e.floor += self.reservation(ask)
        self._where[ask.rollout_id] = e.name

    def _enqueue(self, ask: Ask, front: bool) -> None:
        if front:
            self._queue.appendleft(ask)
        else:
            self._queue.append(ask)

    def _queues(self) -> Iterable[collections.deque[Ask]]:
        return [self._queue]

    def _all_queued(self) -> list[Ask]:
        return [a for q in self._queues() for a in q]

    def _orphan_queue(self, e: _Engine) -> None:
        del e  # one global queue: nothing is tied to an engine until admitted


class KvAwarePolicy(AdmissionPolicy):
    """Most free KV first; the reservation ratio steered by reported KV use; estimates floored
    by reported load. See the module docstring."""

    kind = "kv"
    uses_reports = True

    def __init__(self, capacities: Mapping[str, int], *, initial_ratio: float = 1.0,
                 min_ratio: float = 0.05, target: float = 0.9, high: float = 0.97,
                 decay: float = 0.05, bump: float = 0.25, max_report_age_s: float = 1.0) -> None:
        super().__init__(capacities)
        if not 0 < min_ratio <= initial_ratio <= 1 or not 0 < target <= high <= 1:
            raise ValueError("need 0 < min_ratio <= initial_ratio <= 1 and 0 < target <= high <= 1")
        self.min_ratio = min_ratio
        self.target = target
        self.high = high
        self.decay = decay
        self.bump = bump
        self.max_report_age_s = max_report_age_s
        self._use: dict[str, float] = {}
        self._ratio = initial_ratio

    def carry_over(self) -> dict[str, object]:
        return {"initial_ratio": max(self.min_ratio, min(1.0, self._ratio))}

    def report(self, engine: str, kv_tokens_used: int, kv_tokens_capacity: int | None = None,
               age_s: float = 0.0) -> None:
        super().report(engine, kv_tokens_used, kv_tokens_capacity, age_s)
        e = self._engines.get(engine)
        if e is None or not e.alive or e.capacity <= 0:
            return
        use = kv_tokens_used / e.capacity
        if use > self.high:  # even an old report this high means an engine near preemption
            self._use[engine] = use
            self._ratio = min(1.0, self._ratio + self.bump)
            return
        if age_s > self.max_report_age_s:
            return  # may predate admissions since: not a reason to reserve less
        self._use[engine] = use
        if self._queue:
            alive = [u for n, u in self._use.items() if self._engines[n].alive]
            if sum(alive) / len(alive) < self.target:
                self._ratio = max(self.min_ratio, self._ratio * (1.0 - self.decay))

    def _choose(self, ask: Ask) -> _Engine | None:
        # The hot path of admission (once per admitted rollout, over every engine): the same
        # arithmetic as `estimate`/`_fits`, inlined.
        ctx, rem = ask.context_tokens, ask.remaining_tokens
        r = self._ratio
        best, best_free = None, 0.0
        for e in self._engines.values():
            if not e.alive:
                continue
            est = e.sum_ctx + r * e.sum_rem
            if e.floor is not None and e.floor > est:
                est = e.floor
            free = e.capacity - est
            if e.rollouts and ctx + r * rem > free:
                continue
            if best is None or free > best_free:
                best, best_free = e, free
        return best


class LeastRequestsPolicy(AdmissionPolicy):
    """Fewest running rollouts first; worst-case reservations."""

    kind = "least_requests"

    def _choose(self, ask: Ask) -> _Engine | None:
        best = None
        for e in self._engines.values():
            if self._fits(e, ask) and (best is None or len(e.rollouts) < len(best.rollouts)):
                best = e
        return best


class StaticPolicy(AdmissionPolicy):
    """Fixed split: rollout i -> engine i mod N, each engine with its own FIFO."""

    kind = "static"

    def __init__(self, capacities: Mapping[str, int]) -> None:
        super().__init__(capacities)
        self._rr = itertools.count()

    def _next_alive(self) -> _Engine:
        alive = [e for e in self._engines.values() if e.alive]
        if not alive:
            raise LookupError("no engine alive")
        return alive[next(self._rr) % len(alive)]

    def _enqueue(self, ask: Ask, front: bool) -> None:
        try:
            e = self._next_alive()
        except LookupError:  # nothing alive: park it on the global queue; admit() finds none
            super()._enqueue(ask, front)
            return
        if front:
            e.queue.appendleft(ask)
        else:
            e.queue.append(ask)

    def _queues(self) -> Iterable[collections.deque[Ask]]:
        return [self._queue, *(e.queue for e in self._engines.values())]

    def _orphan_queue(self, e: _Engine) -> None:
        orphans = list(e.queue)
        e.queue.clear()
        for ask in orphans:
            self._enqueue(ask, front=False)

    def admit(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._queue and any(e.alive for e in self._engines.values()):
            parked = list(self._queue)
            self._queue.clear()
            for ask in parked:
                self._enqueue(ask, front=False)
        for e in self._engines.values():
            while e.queue and self._fits(e, e.queue[0]):
                ask = e.queue.popleft()
                self._start(ask, e)
                out.append((ask.rollout_id, e.name))
        return out

    def _choose(self, ask: Ask) -> _Engine | None:  # not used: admit() is per engine
        return None


POLICIES: dict[str, type[AdmissionPolicy]] = {
    "kv": KvAwarePolicy,
    "least_requests": LeastRequestsPolicy,
    "static": StaticPolicy,
}
"""Policy name (`RolloutRunner(policy=...)`) -> class."""


def make_policy(name: str, capacities: Mapping[str, int], **options: object) -> AdmissionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; expected one of "
                         f"{sorted(POLICIES)}") from None
    return cls(capacities, **options)  # type: ignore[arg-type]
