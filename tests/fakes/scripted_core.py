"""The scripted inference core both server fakes share (SGLang's and vLLM's).

Owns: a deterministic "model" (`ScriptedModel`) whose tokens depend on the loaded weights, the
requests a fake server is running, their KV accounting, pause (with or without freeing a paused
request's KV), a "scheduler busy loading weights" gate, the tokens' text (`vocab`, for stop
strings), and the failure knobs (`hang`, `crash_after_tokens`). Each server fake adds
only its wire format on top. Every knob is a JSON-valued attribute, so a test steers it
through the control API (`core.x`, `fakes.control`) of a fake running as its own process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

EOS = 2


class ScriptedModel:
    """Deterministic next-token rule: a hash of (weights, last tokens, position).

    With `script`, the i-th generated token is `script[i % len(script)]` instead. Logprobs are
    a fixed function of the same hash, always < 0.
    """

    def __init__(self, vocab_size: int = 64, script: list[int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.script = script

    def step(self, weights: str, context: list[int], position: int) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(
            f"{weights}|{context[-4:]}|{len(context)}".encode(), digest_size=8).digest(), "big")
        logprob = -0.001 - (h >> 20) % 4000 / 1000.0
        if self.script:
            return self.script[position % len(self.script)], logprob
        return 10 + h % (self.vocab_size - 10), logprob  # ids < 10 are specials


def default_decode(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


class _Req:
    def __init__(self, rid: str, input_ids: list[int]) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.output: list[int] = []
        self.versions: list[str] = []
        self.aborted = False
        self.abort_message = ""
        self.waiting = False
        self.retracted = False
        self.adapter = ""
        """The LoRA adapter (its path) this request is served with; "" = the base."""


class FakeCore:
    """The part both fakes share: requests, KV accounting, pause, weights, failure knobs.

    `free_kv_on_pause` (SGLang's retract) frees a paused request's KV and counts it as queued.
    `scheduler_free` is cleared while weights load: no token is produced meanwhile.
    `vocab` (token id as a string -> its text; unset ids and None: `default_decode`) is what
    stop strings match against and what the text fields carry.
    `crash_after_tokens` (the N-th token generated since launch) ends the whole process.
    """

    def __init__(self, *, model: ScriptedModel | None = None, capacity: int = 4096,
                 token_delay_s: float = 0.0, model_path: str = "/fake/model",
                 crash_after_tokens: int = 0) -> None:
        self.model = model or ScriptedModel()
        self.capacity = capacity
        self.token_delay_s = token_delay_s
        self.vocab: dict[str, str] | None = None
        self.weights = model_path
        self.weight_version = "default"
        self.crash_after_tokens = crash_after_tokens
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.running: dict[str, _Req] = {}
        self.waiting = 0
        self.free_kv_on_pause = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.scheduler_free = asyncio.Event()
        self.scheduler_free.set()
        self.responsive = asyncio.Event()
        self.responsive.set()
        self.tokens_generated = 0
        self.on_change: Callable[[str], None] = lambda event: None
        """Called with "start", "token", "pause" or "end" (for load snapshots)."""

    @property
    def used_tokens(self) -> int:
        return sum(len(r.input_ids) + len(r.output) for r in self.running.values()
                   if not r.retracted)

    @property
    def hang(self) -> bool:
        return not self.responsive.is_set()

    @hang.setter
    def hang(self, value: bool) -> None:
        if value:
            self.responsive.clear()
        else:
            self.responsive.set()

    async def stall_if_hung(self) -> None:
        await self.responsive.wait()

    def decode(self, ids: list[int]) -> str:
        if self.vocab is None:
            return default_decode(ids)
        return "".join(self.vocab.get(str(i), f" t{i}") for i in ids)

    def release(self) -> None:
        """Let go of every request this core holds (a control reset replaces the core): the
        handlers still waiting on it (hung, paused, loading) end instead of leaking."""
        self.abort(all_=True)
        self.hang = False
        self.unpaused.set()
        self.scheduler_free.set()

    async def generate(self, req: _Req, *, max_new: int, stop_ids: set[int],
                       stop_strs: list[str]) -> AsyncIterator[tuple[list[int], list[float],
                                                                    tuple[str, Any] | None]]:
        """Yields (new ids, their logprobs, finish) per step; finish = (kind, matched)."""
        self.running[req.rid] = req
        self.on_change("start")
        try:
            while True:
                if not self.unpaused.is_set():
                    self.waiting += 1
                    req.waiting = True
                    req.retracted = self.free_kv_on_pause
                    self.on_change("pause")
                    try:
                        await self.unpaused.wait()
                    finally:
                        self.waiting -= 1
                        req.waiting = req.retracted = False
                await self.scheduler_free.wait()
                await self.stall_if_hung()
                if req.aborted:
                    yield [], [], ("abort", req.abort_message or "Aborted")
                    return
                weights = f"{self.weights}+lora:{req.adapter}" if req.adapter else self.weights
                tok, lp = self.model.step(weights, req.input_ids + req.output,
                                          len(req.output))
                req.output.append(tok)
                req.versions.append(self.weight_version)
                self.tokens_generated += 1
                if self.crash_after_tokens and self.tokens_generated >= self.crash_after_tokens:
                    os._exit(17)  # a server process dying mid-stream
                self.on_change("token")
                finish: tuple[str, Any] | None = None
                if tok in stop_ids or tok == EOS:
                    finish = ("stop", tok)
                elif stop_strs:
                    text = self.decode(req.output)
                    hit = next((s for s in stop_strs if s in text), None)
                    if hit is not None:
                        finish = ("stop", hit)
                if finish is None and len(req.output) >= max_new:
                    finish = ("length", len(req.output))
                yield [tok], [lp], finish
                if finish is not None:
                    return
                await asyncio.sleep(self.token_delay_s)
        finally:
            self.running.pop(req.rid, None)
            self.on_change("end")

    def abort(self, rid: str | None = None, all_: bool = False, *, prefix: bool = False,
              message: str = "Aborted") -> int:
        n = 0
        for r in self.running.values():
            if all_ or r.rid == rid or (prefix and rid and r.rid.startswith(rid)):
                r.aborted = True
                r.abort_message = message
                n += 1
        return n
