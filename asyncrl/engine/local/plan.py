"""The local engine's batch planner: which requests run in which rows of the batch, step by step.

Owns: a request's loop-side state (`Seq`), the queue of waiting requests, the rows of the
running batch, the KV tokens they hold, and the decision of each step (`Planner.plan` returns a
`Plan`): rows whose request left become dead rows, the newest running requests are preempted
when the next decode step would outgrow the KV budget, waiting requests are admitted in strict
FIFO order while their context, first token and growth reserve fit, the admitted fill dead rows
first, and the batch is compacted to its live rows when the dead would outnumber them or a
draining batch keeps them dead. Does not own: the model, the KV cache or sampling (the engine
runs a plan on its worker thread), streaming tokens to consumers, or request validation (the
engine refuses a request that could never fit before it reaches the queue).

Pure bookkeeping on the event loop: no torch, no I/O, nothing awaited. The KV budget invariant
(`held <= kv_token_budget` once a step's tokens are counted) is kept here; the engine counts
each generated token into `held` and asserts it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass
from typing import Any

from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.log import get_logger

log = get_logger(__name__)

WAITING, RUNNING, DONE = 0, 1, 2
"""A request's `Seq.state`: queued (never admitted, or preempted), in the batch, or ended."""

DRAIN_STEPS = 4
"""Plans in a row with an eighth of the rows dead and nothing waiting before the batch is
compacted to its live rows (`Planner.plan`)."""


class Seq:
    """One request's loop-side state. The worker thread reads it but never writes it."""

    __slots__ = ("admit_order", "generated", "generator", "input_ids", "preemptions", "queue",
                 "rid", "routes", "sampling", "state")

    def __init__(self, request: GenerateRequest, queue: asyncio.Queue[Any], generator: Any) -> None:
        self.rid = request.request_id
        self.input_ids = list(request.input_ids)
        self.sampling: SamplingParams = request.sampling
        self.generated: list[int] = []
        self.queue = queue
        self.state = WAITING
        self.generator = generator
        self.admit_order = 0
        self.preemptions = 0
        self.routes: list[Any] = []
        """With routing recorded: the expert rows of the context so far (`engine._apply`)."""

    @property
    def held(self) -> int:
        """KV tokens this request holds while running (its context incl. the pending token)."""
        return len(self.input_ids) + len(self.generated)

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.generated)


@dataclass
class Plan:
    rows: list[Seq | None]
    """The batch's rows after this step, in cache order; None is a dead row (its request left;
    the row stays in the cache, computed on a dummy token, until a new request takes it or the
    batch is compacted)."""
    compact: list[int] | None
    """Rows of the current cache to keep, in order, before anything else (None: keep all)."""
    freed: list[int]
    """Rows (after compaction) whose request left since the last step: masked out this step."""
    decode: list[int]
    """Rows that get one decode token: those running before this step."""
    fill: list[int]
    """Dead rows taken by requests admitted this step (`prefill` order, first ones)."""
    prefill: list[Seq]
    """Requests admitted this step: prefilled together, then written into `fill`'s rows and,
    for the rest, appended as new rows."""
    version: int


class Planner:
    """The waiting queue and the running batch's rows of one engine, under a KV token budget.

    `kv_token_budget`: tokens the running requests may hold together; `max_running`: rows
    that may run at once; `admit_reserve`: growth tokens a request must have room for beyond its
    first token to be admitted. `name` labels log events.
    """

    def __init__(self, *, kv_token_budget: int, max_running: int, admit_reserve: int,
                 name: str = "") -> None:
        self.kv_token_budget = kv_token_budget
        self.max_running = max_running
        self.admit_reserve = admit_reserve
        self.name = name
        self.waiting: collections.deque[Seq] = collections.deque()
        self.rows: list[Seq | None] = []
        """The batch's rows as of the last plan (None: a dead row)."""
        self.held = 0
        """KV tokens held by the running requests (the engine adds each generated token)."""
        self.preemptions = 0
        self._admit_seq = itertools.count()
        self._drain = 0  # plans in a row with dead rows and nothing waiting (`plan`)

    @property
    def running(self) -> int:
        """Requests running in the batch."""
        return sum(1 for s in self.rows if s is not None and s.state == RUNNING)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running: no step to plan."""
        return not self.waiting and not any(
            s is not None and s.state == RUNNING for s in self.rows)

    def leave(self, seq: Seq) -> None:
        """`seq` ended (finished, aborted or failed): its tokens are no longer held, or it
        leaves the queue. Its row, if any, becomes a dead row at the next plan."""
        if seq.state == RUNNING:
            self.held -= seq.held
        elif seq.state == WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.state = DONE

    def plan(self, version: int) -> Plan:
        """Decide this step: rows freed, compaction, preemptions, admissions and where the
        admitted go; `version` is the policy version the step's tokens carry. Keeps
        held <= budget."""
        rows = list(self.rows)
        freed = [i for i, s in enumerate(rows) if s is not None and s.state != RUNNING]
        for i in freed:
            rows[i] = None
        live = [i for i, s in enumerate(rows) if s is not None]
        # Each decode row grows by one token; preempt the newest rows until that fits.
        while live and self.held + len(live) > self.kv_token_budget:
            j = max(live, key=lambda i: rows[i].admit_order)  # type: ignore[union-attr]
            victim = rows[j]
            assert victim is not None
            live.remove(j)
            rows[j] = None
            freed.append(j)
            self.held -= victim.held
            victim.state = WAITING
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
            log.debug("engine_preempt", engine=self.name, request_id=victim.rid)
        prefill = self._admit(self.held + len(live), len(live))
        # Dead rows cost a forward each step but moving the cache costs a copy of all of it:
        # compact when the dead would outnumber the live after the admitted fill them, or when
        # an eighth of the rows have stayed dead for DRAIN_STEPS plans with nothing waiting to
        # take them (the batch draining at the end of a wave: the copy pays for itself within
        # a few steps, and a request that comes back soon, a tool call's continuation, still
        # finds its dead row).
        compact = None
        dead = len(rows) - len(live) - min(len(rows) - len(live), len(prefill))
        self._drain = self._drain + 1 if (dead and not self.waiting and
                                          dead >= len(rows) // 8) else 0
        if dead > len(live) + len(prefill) or self._drain > DRAIN_STEPS:
            compact, rows = live, [rows[i] for i in live]
            freed, live = [], list(range(len(live)))
            self._drain = 0
        holes = [i for i, s in enumerate(rows) if s is None][:len(prefill)]
        for i, seq in zip(holes, prefill, strict=False):
            rows[i] = seq
        rows.extend(prefill[len(holes):])
        self.rows = rows
        return Plan(rows=rows, compact=compact, freed=freed, decode=live, fill=holes,
                    prefill=prefill, version=version)

    def _admit(self, projected: int, live: int) -> list[Seq]:
        """Admit waiting requests, head first, while a row is free and the KV tokens held after
        the next step (`projected`, with `live` rows decoding) leave room for each one's
        context, first token and growth reserve."""
        prefill: list[Seq] = []
        while self.waiting and live + len(prefill) < self.max_running:
            seq = self.waiting[0]
            reserve = min(seq.remaining - 1, self.admit_reserve)
            if projected + seq.held + 1 + reserve > self.kv_token_budget:
                break  # strict FIFO: the head waits for room, nothing overtakes it
            self.waiting.popleft()
            seq.state = RUNNING
            seq.admit_order = next(self._admit_seq)
            self.held += seq.held
            projected += seq.held + 1
            prefill.append(seq)
        return prefill
