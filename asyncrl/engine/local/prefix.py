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
context to its longest kept prefix, and dropping entries a weight update made stale. Does not
own: reading rows out of the batch cache or prefilling (the engine and its batch). Used by the
engine's worker thread only, so there is no lock.

Memory: an entry costs its tokens x (layers x 2 x kv heads x head dim x dtype size), 46 KiB
a token for SmolLM2-135M in fp32; the budget (`engine.prefix_cache_tokens`) bounds the total.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

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
        token: the last is fed to get the next token's logits) and that prefix's length,
        removed from the store; None when no entry of `version` shares MIN_REUSE tokens."""
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
        entry = self._entries.pop(best)
        self.held -= len(entry.tokens)
        self.hits += 1
        self.reused_tokens += best_n
        return entry, best_n

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
