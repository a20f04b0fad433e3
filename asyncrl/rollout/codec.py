"""Text to token ids and back for the rollout loop, without stalling it.

Owns: `Codec` (one per tokenizer, shared by every rollout): `decode` on the loop through a
byte table where the tokenizer allows it, and `aencode`, which tokenizes on a worker thread.
Does not own: what is encoded (the agent loop) or the tokenizer itself.

Why a thread: the `tokenizers` library spends 0.3-0.8 us per character in a single `encode`
and holds the GIL throughout; a tool response (100-400 characters with its wrapper) cost
150-400 us of loop time at every tool return in the 1,000-rollout bench, long enough to delay
other rollouts' tool calls behind it. Its batch encode releases the GIL, so on the worker the
loop keeps running; the loop's own share is a queue put and one callback per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

Job = tuple[str, "asyncio.Future[list[int]]", asyncio.AbstractEventLoop]


class Codec:
    """`Codec.of(tokenizer)`: the shared codec of a tokenizer (built once: a 150k vocabulary's
    decode table takes ~0.3 s, so build it in set-up, not on a running loop).

    - `decode(ids) -> str`: what `tokenizer.decode(ids)` returns (special tokens kept).
    - `bytes_of(ids) -> bytes` (or None): for byte-level tokenizers, the UTF-8 bytes that
      `decode` decodes with replacement; pieces of a text join into the text's bytes.
    - `encode(text) -> list[int]`: `tokenizer.encode(text, add_special_tokens=False)`.
    - `await aencode(text)`: the same ids as `encode`, computed off the event loop when the
      tokenizer is backed by the `tokenizers` library (on the loop otherwise: a pure-Python
      tokenizer holds the GIL, so a thread would not free the loop); `aencode_many(texts)`
      for a list.

    The fast paths are taken only where they are exactly the tokenizer: its `tokenizers`
    backend when the wrapper does no Python-side clean-up, and the decode table only when it
    equals the backend's decode on the whole vocabulary.
    """

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self.decode: Callable[[list[int]], str] = tokenizer.decode
            self.encode: Callable[[str], list[int]] = (
                lambda text: tokenizer.encode(text, add_special_tokens=False))
            self._jobs: queue.SimpleQueue[Job | None] | None = None
            self.bytes_of: Callable[[list[int]], bytes] | None = None
            return
        self.bytes_of = _byte_table(backend)
        if self.bytes_of is not None:
            bytes_of = self.bytes_of
            self.decode = lambda ids: bytes_of(ids).decode("utf-8", "replace")
        else:
            self.decode = lambda ids: backend.decode(ids, skip_special_tokens=False)
        self.encode = lambda text: backend.encode(text, add_special_tokens=False).ids
        batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        self._encode_many: Callable[[list[str]], list[list[int]]] = (
            lambda texts: [e.ids for e in batch(texts, add_special_tokens=False)])
        self._jobs = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    @classmethod
    def of(cls, tokenizer: Any) -> Codec:
        """The codec of `tokenizer`, cached while the tokenizer lives. Only codecs over a
        `tokenizers` backend are cached (they hold the backend, not the tokenizer, so the cache
        does not keep it alive); any other codec is cheap and made anew."""
        try:
            codec = _CODECS.get(tokenizer)
        except TypeError:  # not weakly referenceable
            return cls(tokenizer)
        if codec is None:
            codec = cls(tokenizer)
            if codec._jobs is not None:
                _CODECS[tokenizer] = codec
        return codec

    async def aencode(self, text: str) -> list[int]:
        """`encode(text)` without holding the event loop (see the class docstring)."""
        if self._jobs is None:
            return self.encode(text)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        if self._worker is None:
            self._start()
        self._jobs.put((text, fut, loop))
        return await fut

    async def aencode_many(self, texts: list[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, off the event loop as `aencode` (one batch)."""
        if self._jobs is None:
            return [self.encode(text) for text in texts]
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[list[int]]] = [loop.create_future() for _ in texts]
        if self._worker is None:
            self._start()
        for text, fut in zip(texts, futs, strict=True):
            self._jobs.put((text, fut, loop))
        try:
            return [await fut for fut in futs]
        finally:
            for fut in futs:
                fut.cancel()  # no-op for the done ones; the rest are skipped on delivery

    def _start(self) -> None:
        with self._lock:
            if self._worker is not None:
                return
            jobs = self._jobs
            assert jobs is not None
            # The thread holds the queue and the encode function, never the codec: when the
            # codec is collected, the finalizer's sentinel ends the thread.
            worker = threading.Thread(target=_serve, args=(jobs, self._encode_many),
                                      name="asyncrl-codec", daemon=True)
            worker.start()
            weakref.finalize(self, jobs.put, None)
            self._worker = worker

    def _forget_worker(self) -> None:
        """In a forked child: the worker thread did not come along; the next call starts one."""
        self._jobs = queue.SimpleQueue()
        self._worker = None
        self._lock = threading.Lock()


_CODECS: weakref.WeakKeyDictionary[Any, Codec] = weakref.WeakKeyDictionary()
_LIVE: weakref.WeakSet[Codec] = weakref.WeakSet()
"""Codecs that may have a worker: a child made by `fork` must not queue jobs to a thread that
exists only in its parent (it would wait forever)."""


def _after_fork_in_child() -> None:
    for codec in list(_LIVE):
        codec._forget_worker()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _serve(jobs: queue.SimpleQueue[Job | None], encode_many: Callable[[list[str]], list[list[int]]]
           ) -> None:
    """The worker: take every waiting job, encode them in one call (GIL released inside),
    hand the results back with one callback per event loop."""
    while True:
        job = jobs.get()
        if job is None:
            return
        batch = [job]
        stop = False
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            batch.append(job)
        texts = [text for text, _, _ in batch]
        out: list[list[int] | Exception]
        try:
            out = list(encode_many(texts))
        except Exception:  # one bad text must not fail the batch: encode each on its own
            out = []
            for text in texts:
                try:
                    out.append(encode_many([text])[0])
                except Exception as e:  # handed to that text's caller
                    out.append(e)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[list[int]], Any]]] = {}
        for (_, fut, loop), ids in zip(batch, out, strict=True):
            by_loop.setdefault(loop, []).append((fut, ids))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_deliver, items)
        if stop:
            return


def _deliver(items: list[tuple[asyncio.Future[list[int]], Any]]) -> None:
    for fut, ids in items:
        if fut.done():  # its caller was cancelled
            continue
        if isinstance(ids, Exception):
            fut.set_exception(ids)
        else:
            fut.set_result(ids)


def _byte_table(backend: Any) -> Callable[[list[int]], bytes] | None:
    """For a byte-level BPE decoder (Qwen, GPT-2 style): `bytes_of(ids)`, the join of each
    token's bytes, whose UTF-8 decoding with replacement is what the backend's decode computes
    (a token whose characters are all in the byte alphabet maps through it, any other token,
    e.g. an added one holding a newline, is its own UTF-8). Bytes join, so a text can be built
    a piece at a time. In the loop's process the backend's decode spends most of its time in
    the C allocator of a heap fragmented by thousands of growing token lists (~65 us for a
    100-token call, 4x its cost in a fresh process); the table is a few microseconds. Checked
    against the backend on the whole vocabulary at construction: None (use the backend) for
    any other decoder or any difference."""
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    chars = bs + [256 + n for n in range(256 - len(bs))]
    byte_of = dict(zip(map(chr, chars), [*bs, *(b for b in range(256) if b not in bs)],
                       strict=True))
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for i in range(size):
        tok = backend.id_to_token(i)
        if tok is None:
            return None
        try:
            table.append(bytes(byte_of[c] for c in tok))
        except KeyError:
            table.append(tok.encode())
    piece = table.__getitem__

    def bytes_of(ids: list[int]) -> bytes:
        try:
            if not ids or min(ids) >= 0:
                return b"".join(map(piece, ids))
        except IndexError:  # an id past the tokenizer's vocabulary (a model's padded rows)
            pass
        # the backend skips ids it has no token for
        return b"".join([table[i] for i in ids if 0 <= i < size])

    probe = list(range(size)) + list(range(size - 1, -1, -1))
    if bytes_of(probe).decode("utf-8", "replace") != backend.decode(probe,
                                                                    skip_special_tokens=False):
        return None
    return bytes_of
