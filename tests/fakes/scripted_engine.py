"""A scripted policy behind the `Engine` protocol: replays given token streams.

Each request belongs to a rollout (the request id up to the first "/", as the agent loop
writes it) and replays the scripted turn it asks for (`rollout/t<n>/...`).
Sampling rules are honoured like a real engine: a turn is cut at `max_new_tokens` ("length"),
at a stop token id or at a stop string ("stop", included). Running out of script ends the turn
with "stop". It records every request, can fail or hang on purpose, and reports load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.errors import EngineError, EngineUnavailable

Script = Sequence[Sequence[int]]


class ScriptedEngine:
    """`ScriptedEngine(script, tokenizer=None, *, name, chunk=1, delay_s=0.0, capacity,
    fail_after_tokens=None, hang_after_tokens=None, error_after_tokens=None)`.

    `script` is one list of turns used for every rollout, or `fn(rollout_id) -> turns`.
    `tokenizer` enables stop strings. `chunk` tokens per delta, `delay_s` sleep per delta.
    `fail_after_tokens`: after that many tokens in total the engine dies (`EngineUnavailable`
    now and for every later request). `hang_after_tokens`: it stops answering instead.
    `error_after_tokens`: one request fails with a plain `EngineError`.
    `context_window`: like a server's maximum model length, a turn stops with "length" when
    prompt and output reach it, whatever `max_new_tokens` allows.
    """

    def __init__(self, script: Script | Callable[[str], Script], tokenizer: Any = None, *,
                 name: str = "scripted-0", chunk: int = 1, delay_s: float = 0.0,
                 capacity: int = 1_000_000, fail_after_tokens: int | None = None,
                 hang_after_tokens: int | None = None,
                 error_after_tokens: int | None = None,
                 context_window: int | None = None) -> None:
        self.name = name
        self.policy_version = 0
        self._script = script if callable(script) else (lambda _rid: script)
        self._tok = tokenizer
        self.chunk = chunk
        self.delay_s = delay_s
        self.capacity = capacity
        self.fail_after_tokens = fail_after_tokens
        self.hang_after_tokens = hang_after_tokens
        self.error_after_tokens = error_after_tokens
        self.context_window = context_window
        self.dead = False
        self.closed = False
        self.requests: list[GenerateRequest] = []
        self.request_times: list[float] = []
        self.tokens_sent = 0
        self._turn_of: dict[str, int] = {}
        self._active: dict[str, int] = {}
        self._aborted: set[str] = set()
        self._served: dict[tuple[str, int], tuple[int, int]] = {}
        """(rollout, turn) -> (context length before the turn, turn tokens generated)."""

    def _turn_for(self, request: GenerateRequest) -> tuple[list[int], tuple[str, int], int]:
        """The scripted turn this request asks for: the agent loop names the turn index in the
        request id (`rollout/t<n>/...`), so a rollout resumed on another engine replays the
        right turn; other ids count requests per rollout."""
        parts = request.request_id.rsplit("/", 2)
        rid = parts[0]
        if len(parts) > 1 and parts[1][:1] == "t" and parts[1][1:].isdigit():
            n = int(parts[1][1:])
        else:
            n = self._turn_of.get(rid, 0)
            self._turn_of[rid] = n + 1
        turns = self._script(rid)
        turn = list(turns[n]) if n < len(turns) else []
        # A request whose context is the last request of the same turn plus all it generated
        # continues that turn (the agent loop goes on past a stop string that is text), as a
        # real engine continues from its context; any other request starts the turn over.
        prev = self._served.get((rid, n))
        start = prev[1] if prev is not None and len(request.input_ids) == sum(prev) else 0
        return turn[start:], (rid, n), len(request.input_ids) - start

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self.dead:
            raise EngineUnavailable(f"{self.name} is down")
        if self.closed:
            raise EngineUnavailable(f"{self.name} is closed")
        self.requests.append(request)
        self.request_times.append(time.perf_counter())
        sp = request.sampling
        turn, key, base = self._turn_for(request)
        out: list[int] = []
        finish = "stop"
        limit = sp.max_new_tokens
        if self.context_window is not None:
            limit = min(limit, self.context_window - len(request.input_ids))
        for tok in turn:
            if len(out) >= limit:
                finish = "length"
                break
            out.append(tok)
            if tok in sp.stop_token_ids:
                break
            if sp.stop_strings and self._tok is not None:
                text = self._tok.decode(out)
                if any(text.endswith(s) for s in sp.stop_strings):
                    break
        else:
            if len(out) >= limit:
                finish = "length"
        self._active[request.request_id] = len(request.input_ids)
        done = len(request.input_ids) - base
        self._served[key] = (base, done + len(out))
        try:
            for i in range(0, max(len(out), 1), self.chunk):
                part = out[i:i + self.chunk]
                await self._maybe_fail(len(part))
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                if request.request_id in self._aborted:
                    yield TokenDelta(token_ids=[], logprobs=[], finish_reason="abort",
                                     policy_version=self.policy_version)
                    return
                self.tokens_sent += len(part)
                self._active[request.request_id] += len(part)
                last = i + self.chunk >= len(out)
                if last:  # a real engine frees a request's KV when it finishes, before its
                    # consumer reads the last delta (not when the stream is closed)
                    self._active.pop(request.request_id, None)
                yield TokenDelta(token_ids=part, logprobs=[-0.5] * len(part),
                                 finish_reason=finish if last else None,
                                 policy_version=self.policy_version)
        finally:
            self._active.pop(request.request_id, None)

    async def _maybe_fail(self, n: int) -> None:
        if self.dead:
            raise EngineUnavailable(f"{self.name} is down")
        upcoming = self.tokens_sent + n
        if self.fail_after_tokens is not None and upcoming > self.fail_after_tokens:
            self.dead = True
            raise EngineUnavailable(f"{self.name} died")
        if self.hang_after_tokens is not None and upcoming > self.hang_after_tokens:
            await asyncio.Event().wait()  # stops answering; the caller's deadline must fire
        if self.error_after_tokens is not None and upcoming > self.error_after_tokens:
            self.error_after_tokens = None
            raise EngineError(f"{self.name}: request failed")

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def load(self) -> EngineLoad:
        if self.dead:
            raise EngineUnavailable(f"{self.name} is down")
        return EngineLoad(kv_tokens_used=sum(self._active.values()),
                          kv_tokens_capacity=self.capacity, running=len(self._active), waiting=0)

    async def update_weights(self, update: WeightUpdate) -> None:
        self.policy_version = update.version

    async def close(self) -> None:
        self.closed = True
