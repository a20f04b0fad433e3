"""The local engine's continuation cache: the keys and values of requests that stopped, kept for
the request that continues them.

A multi-turn rollout stops at a tool call, runs the tool, and sends the whole context again:
prompt, what it generated, the tool's output. Prefilled from scratch, the second request
recomputes every earlier token (a profile of a word-problem evaluation on SmolLM2 put 28% of
the time in prefill). `PrefixStore` keeps, for each request that finished with "stop", a copy
of its row of the KV cache (every token it held: its input and what it generated, not the last
sampled token, whose key was never computed); a request whose context starts with a kept
one's tokens takes that copy and the engine prefills only the rest (`engine._prefill`). The
keys and values of a prefix do not depend on what follows it, so any common prefix serves,
not only a whole entry.

Owns: the entries, their token budget (least recently stored dropped first), matching a
context to its longest kept prefix, dropping entries a weight update made stale, and the
prefill of contexts over kept prefixes (`prefill_continuations`). Does not
own: reading rows out of the batch cache, or where prefilled rows go (the engine and its
batch). Used by the
engine's worker thread only, so there is no lock.

Memory: an entry costs its tokens x (layers x 2 x kv heads x head dim x dtype size), 46 KiB
a token for SmolLM2-135M in fp32; the budget (`engine.prefix_cache_tokens`) bounds the total.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

MIN_REUSE = 16
"""Common-prefix tokens below which an entry is not worth taking (a plain prefill is as cheap
as gathering it)."""


@dataclass
class Entry:
    tokens: list[int]
    """The tokens whose keys and values `kv` holds, in order."""
    kv: list[tuple[Any, Any]]
    """Per attention layer, (keys, values) as `[kv heads, len(tokens), head dim]`."""
    version: int
    """The policy version of the weights that computed them."""
    stored: float = field(default_factory=time.monotonic)


class PrefixStore:
    """Kept KV rows of stopped requests, at most `capacity` tokens in all (see the module
    docstring). `hits` and `reused_tokens` count what `take` handed out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.hits = 0
        self.reused_tokens = 0
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keeps(self, n: int) -> bool:
        """Whether an entry of `n` tokens would be kept (worth copying out)."""
        return MIN_REUSE <= n <= self.capacity

    def put(self, tokens: list[int], kv: list[tuple[Any, Any]], version: int) -> None:
        """Keep `kv` for `tokens` (copied by the caller: the store owns it), dropping the
        oldest entries while over capacity. An entry longer than the whole budget, or too short
        to be worth taking, is not kept."""
        n = len(tokens)
        if not self.keeps(n):
            return
        while self._entries and self.held + n > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.held -= len(old.tokens)
        self._entries[self._next] = Entry(list(tokens), kv, version)
        self._next += 1
        self.held += n

    def take(self, context: list[int], version: int) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `context` (at most all but its last
        token: the last is fed to get the next token's logits) and that prefix's length; None
        when no entry of `version` shares MIN_REUSE tokens. The caller copies what it uses.

        An entry `context` continues whole (its own request's next turn) leaves the store; one
        it shares only a part of stays. Another problem's prompt shares the system prompt with
        every entry, and a group's other samples share their prompt: were a partial match to
        remove the entry, the request it was kept for would find it gone when its tool call
        returns and prefill its whole context again (an evaluation of SmolLM2 reused 62 tokens
        a hit, about the system prompt, that way)."""
        limit = len(context) - 1
        best, best_n = None, MIN_REUSE - 1
        for key, e in self._entries.items():
            if e.version != version:
                continue
            n = _common(e.tokens, context, limit)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        entry = self._entries[best]
        if best_n == len(entry.tokens):
            del self._entries[best]
            self.held -= len(entry.tokens)
        self.hits += 1
        self.reused_tokens += best_n
        return entry, best_n

    def stats(self) -> dict[str, int]:
        """What was handed out and what is kept (the engine's `engine_prefix_cache` log)."""
        return dict(hits=self.hits, reused_tokens=self.reused_tokens, kept=len(self),
                    kept_tokens=self.held)

    def clear(self) -> None:
        """Drop every entry (new weights make them stale)."""
        self._entries.clear()
        self.held = 0

    def expire(self, max_age_s: float) -> None:
        """Drop entries kept longer than `max_age_s` (their rollouts ended or were dropped)."""
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if now - e.stored > max_age_s]:
            self.held -= len(self._entries.pop(key).tokens)


def _common(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`: list comparisons (C loops)
    in a binary search, not a Python loop per token (a prefill compares every context with
    every entry, each hundreds of tokens)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefill_continuations(model: Any, cache: Any, pad_id: int, ctxs: list[list[int]],
                          hits: list[Any]) -> tuple[Any, Any, Any]:
    """Prefill `ctxs` on `model` into `cache` (an empty `kvcache.growing_cache`), where
    `hits[i]` is a kept prefix of `ctxs[i]` (`PrefixStore.take`'s entry and length, or None;
    at least one is not): the kept keys and values are the past, right-aligned, and only the
    rest of each context is fed, right-aligned after them; the model masks the gaps. Returns the
    cache rearranged as a plain prefill leaves it (each row's tokens right-aligned, left
    padding masked), that mask, and each row's last logits."""
    dev = model.device
    reuse = [h[1] if h else 0 for h in hits]
    rest = [len(c) - p for c, p in zip(ctxs, reuse, strict=True)]
    n, big_p, big_s = len(ctxs), max(reuse), max(rest)
    for li, layer in enumerate(cache.layers):
        k0, v0 = next(h for h in hits if h)[0].kv[li]
        k = k0.new_zeros((n, k0.shape[0], big_p, k0.shape[2]))
        v = v0.new_zeros((n, v0.shape[0], big_p, v0.shape[2]))
        for i, h in enumerate(hits):
            if h:
                k[i, :, big_p - h[1]:] = h[0].kv[li][0][:, :h[1]]
                v[i, :, big_p - h[1]:] = h[0].kv[li][1][:, :h[1]]
        layer.replace(k, v, room=big_s)
    ids = torch.full((n, big_s), pad_id, dtype=torch.long)
    mask = torch.zeros((n, big_p + big_s), dtype=torch.long)
    pos = torch.zeros((n, big_s), dtype=torch.long)
    for i, (c, p, r) in enumerate(zip(ctxs, reuse, rest, strict=True)):
        ids[i, big_s - r:] = torch.tensor(c[p:], dtype=torch.long)
        mask[i, big_p - p:big_p] = 1
        mask[i, big_p + big_s - r:] = 1
        pos[i, big_s - r:] = torch.arange(p, p + r)
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    # Each row's real columns (kept, then new) gathered right-aligned; the left padding
    # repeats a real column (finite, masked), as a plain prefill's pads are finite.
    lens = [len(c) for c in ctxs]
    width = max(lens)
    idx = torch.zeros((n, width), dtype=torch.long)
    plain = torch.zeros((n, width), dtype=torch.long)
    for i, (p, r, ln) in enumerate(zip(reuse, rest, lens, strict=True)):
        cols = [*range(big_p - p, big_p), *range(big_p + big_s - r, big_p + big_s)]
        idx[i, :width - ln] = cols[0]
        idx[i, width - ln:] = torch.tensor(cols)
        plain[i, width - ln:] = 1
    idx = idx.to(dev)
    for layer in cache.layers:
        kk, vv = layer.keys, layer.values
        layer.keys = kk.gather(2, idx[:, None, :, None].expand(
            n, kk.shape[1], width, kk.shape[3]))
        layer.values = vv.gather(2, idx[:, None, :, None].expand(
            n, vv.shape[1], width, vv.shape[3]))
    return cache, plain.to(dev), out.logits[:, -1, :]
