"""Simulated engines and a simulated sandbox for the event-loop benches (no model, no GPU).

`SimEngine` implements the `asyncrl.engine.base.Engine` protocol on the event loop: each
request "decodes" at a GPU-like rate and a timer delivers a delta every `stream_interval`
tokens, like an SGLang stream read off a socket. Token content comes from
a script function (one turn per request), so the real agent loop, tokenizer decode and call
parsing run unchanged. `SimSandbox` stands in for a sandbox client with a latency model.

Used by `bench/tool_fire.py` and `bench/loop_capacity.py`; never imported by tests.
"""

from __future__ import annotations

import array
import asyncio
import collections
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.errors import EngineUnavailable

Stamp = tuple[float, float]
"""(wall clock `perf_counter`, this thread's CPU clock `thread_time`). The CPU clock counts only
work this process's loop thread did, so on a shared, contended machine it gives the latency a
dedicated core would see; the wall clock includes time the OS gave to other processes."""

FinalHook = Callable[[str, Stamp, Stamp], None]
"""`hook(request_id, put, received)` for each request's last delta."""


def stamp() -> Stamp:
    return time.perf_counter(), time.thread_time()


class _Req:
    __slots__ = ("ctx", "finish", "handle", "items", "rate", "rid", "sent", "t0", "tokens",
                 "waiter")

    def __init__(self, rid: str, tokens: array.array, finish: str, ctx: int, t0: float,
                 rate: float) -> None:
        self.rid = rid
        self.tokens = tokens
        self.finish = finish
        self.sent = 0
        self.ctx = ctx
        self.t0 = t0
        self.rate = rate
        self.items: collections.deque[tuple[TokenDelta, Stamp]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.handle: asyncio.TimerHandle | None = None


class SimEngine:
    """`SimEngine(name, script, *, step_s=0.03, tokens_per_step=1, stream_interval=8,
    kv_capacity=10**9, on_final=None)`; `script(request)` returns the turn to replay (a sequence
    of ints; scripts keep their plans as `array`s, see `turn_array`).

    Each request decodes `tokens_per_step` tokens per `step_s` (x a per-request +-10% rate
    jitter) from one step after it arrives; a delta is delivered by a timer when
    `stream_interval` more tokens are due (or the turn ends). The engine's own cost on the loop
    is one timer callback per delta, standing in for reading one streamed chunk off a socket;
    there is no per-step loop over all requests (that work is the GPU server's, not the
    orchestrator's). Requests are never delayed by the loop: a late timer delivers every token
    due by then.
    """

    def __init__(self, name: str, script: Callable[[GenerateRequest], list[int]], *,
                 step_s: float = 0.03, tokens_per_step: int = 1, stream_interval: int = 8,
                 kv_capacity: int = 10**9, on_final: FinalHook | None = None) -> None:
        self.name = name
        self.policy_version = 0
        self.script = script
        self.step_s = step_s
        self.tokens_per_step = tokens_per_step
        self.stream_interval = stream_interval
        self.kv_capacity = kv_capacity
        self.on_final = on_final
        self.deltas = 0
        self.tokens = 0
        self._active: dict[str, _Req] = {}
        self._running = False
        self._kv_used = 0
        self._rng = random.Random(name)

    async def __aenter__(self) -> SimEngine:
        self._running = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._running = False
        for r in self._active.values():
            if r.handle is not None:
                r.handle.cancel()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if not self._running:
            raise EngineUnavailable(f"{self.name} is not running")
        sp = request.sampling
        # In a real run the turn's tokens exist only on the GPU server; an `array` keeps them out
        # of the orchestrator's garbage collector (a list or tuple of 10,000 rollouts' turns
        # is millions of references that the collector would visit and the product would not).
        turn = turn_array(self.script(request))
        finish = "stop"
        if len(turn) > sp.max_new_tokens:
            turn, finish = turn[: sp.max_new_tokens], "length"
        loop = asyncio.get_running_loop()
        rate = self.tokens_per_step / (self.step_s * self._rng.uniform(0.9, 1.1))
        r = _Req(request.request_id, turn, finish, len(request.input_ids),
                 loop.time() + self.step_s, rate)
        del request  # only its length was needed
        self._active[r.rid] = r
        self._kv_used += r.ctx
        self._schedule(r, loop)
        try:
            while True:
                if not r.items:
                    r.waiter = loop.create_future()
                    await r.waiter
                    r.waiter = None
                delta, t_put = r.items.popleft()
                if delta.finish_reason is not None and self.on_final is not None:
                    self.on_final(r.rid, t_put, stamp())
                if delta.finish_reason is not None:
                    yield delta
                    return
                yield delta
                delta = None  # type: ignore[assignment]  # not kept alive while waiting
        finally:
            if r.handle is not None:
                r.handle.cancel()
            self._active.pop(r.rid, None)
            self._kv_used -= r.ctx + r.sent

    def _schedule(self, r: _Req, loop: asyncio.AbstractEventLoop) -> None:
        nxt = min(len(r.tokens), r.sent + self.stream_interval)
        r.handle = loop.call_at(r.t0 + max(nxt, 1) / r.rate, self._emit, r, loop)

    def _emit(self, r: _Req, loop: asyncio.AbstractEventLoop) -> None:
        r.handle = None
        due = int((loop.time() - r.t0) * r.rate)
        pos = min(len(r.tokens), max(due, r.sent + self.stream_interval))
        ids = r.tokens[r.sent:pos].tolist()
        r.sent = pos
        self._kv_used += len(ids)
        done = pos >= len(r.tokens)
        d = TokenDelta(token_ids=ids, logprobs=[-1.0] * len(ids),
                       finish_reason=r.finish if done else None,
                       policy_version=self.policy_version)
        r.items.append((d, stamp() if done else (0.0, 0.0)))  # clocks only where measured
        self.deltas += 1
        self.tokens += len(ids)
        if r.waiter is not None and not r.waiter.done():
            r.waiter.set_result(None)
        if not done:
            self._schedule(r, loop)

    async def abort(self, request_id: str) -> None:
        r = self._active.get(request_id)
        if r is not None:
            if r.handle is not None:
                r.handle.cancel()
            r.items.append((TokenDelta(token_ids=[], logprobs=[], finish_reason="abort"),
                            stamp()))
            if r.waiter is not None and not r.waiter.done():
                r.waiter.set_result(None)

    async def load(self) -> EngineLoad:
        return EngineLoad(kv_tokens_used=self._kv_used, kv_tokens_capacity=self.kv_capacity,
                          running=len(self._active), waiting=0)

    async def update_weights(self, update: WeightUpdate) -> None:
        self.policy_version = update.version


class _Result:
    """Duck-typed `sandbox.ExecResult`."""

    __slots__ = ("detail", "duration_s", "exit_code", "status", "stderr", "stdout", "truncated")

    def __init__(self, stdout: str, duration_s: float) -> None:
        self.status = "ok"
        self.stdout = stdout
        self.stderr = ""
        self.exit_code = 0
        self.duration_s = duration_s
        self.truncated = False
        self.detail = ""


class SimSandbox:
    """A sandbox client whose calls take a latency drawn from `latency()` (seconds).

    `on_execute(request)` runs synchronously the instant `execute` is entered (the moment the
    request is "sent"), before any await.
    """

    def __init__(self, latency: Callable[[], float], *,
                 on_execute: Callable[[Any], None] | None = None) -> None:
        self.latency = latency
        self.on_execute = on_execute
        self.calls = 0
        self.isolation = "simulated"

    async def execute(self, req: Any) -> _Result:
        if self.on_execute is not None:
            self.on_execute(req)
        self.calls += 1
        d = self.latency()
        await asyncio.sleep(d)
        return _Result("42\n", d)

    async def aclose(self) -> None:
        return None


def turn_array(tokens) -> array.array:
    """A scripted turn as an `array` of token ids: not a container the garbage collector
    tracks (the simulation's own bookkeeping must not weigh on the loop it measures)."""
    return tokens if isinstance(tokens, array.array) else array.array("i", tokens)


def lognormal(median_s: float, sigma: float, rng: random.Random) -> Callable[[], float]:
    """A latency model: lognormal with the given median and log-space sigma."""
    import math

    mu = math.log(median_s)
    return lambda: rng.lognormvariate(mu, sigma)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


class LagMonitor:
    """Event-loop lag: a task sleeps `interval_s` repeatedly and records how late it wakes."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self.recording = False

    async def __aenter__(self) -> LagMonitor:
        self._task = asyncio.create_task(self._run(), name="lag-monitor")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            if self.recording:
                self.lags.append(max(0.0, loop.time() - t - self.interval_s))


def bench_tokenizer() -> Any:
    """A small byte-level BPE tokenizer with the chat/tool markup (built locally, ~1 s)."""
    from asyncrl.modeling import train_tokenizer

    rng = random.Random(0)
    corpus = []
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        corpus.append(f"Let me compute {a} + {b} step by step. We need the sum of the numbers "
                      f"and then check the result carefully. <reason> </reason> <answer>\\boxed{{{a + b}}}</answer>")
    return train_tokenizer(corpus, vocab_size=1024)


def cpu_seconds() -> float:
    return time.process_time()


def loadavg() -> float | None:
    """The machine's 1-minute load average (a contended machine inflates every latency)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
