"""The local engine's KV cache layer: HF's dynamic layer without a full copy per decode step.

Owns: where one attention layer's keys and values live between the engine's steps. HF's
`DynamicLayer` concatenates every new token onto the whole cache (a copy of `[rows, heads,
length, dim]` per layer per step: quadratic in the length). `GrowingLayer` keeps the same
`keys` / `values` attributes, but as views into a buffer with spare columns: a decode step
writes one column in place, and the buffer grows by half again when full (amortised O(1) per
token). Dropping leading columns (the engine trims all-padding columns as rows leave) is a view
into the same buffer, so it copies nothing either, and so is taking such columns back
(`widen_left`, when a longer request moves into a dead row). New tensors (rows selected, new
rows merged) go in through `replace`, one copy into a fresh buffer that frees the old one at
once; anything else that assigns `keys` / `values` is adopted the same way on the next update.
Does not own: which rows or columns are in the batch (the engine).

Memory. The headroom of a fresh buffer is half its length again, at most `GROW_MAX` columns
(plus `_SPARE`): with 64 rows of SmolLM2-135M a column is 2.9 MiB over its 30 layers, so an
unbounded half of a 600-column batch would hold 0.8 GiB of columns not yet written; the cap
costs one copy of the cache per 96 decode steps at the least. `replace`
frees the old buffer layer by layer; assigning the new tensors and leaving the adoption to the
next decode step kept every layer's old buffer and its replacement alive together, doubling
the whole cache each time requests joined the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_SPARE = 64
"""Columns of headroom a fresh buffer gets beyond its growth (`GROW_MAX`)."""

GROW_MAX = 32
"""The most columns a fresh buffer grows by beyond its length (half its length when shorter),
before `_SPARE`: a full buffer is copied once per this many decode steps at the least."""


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose updates append in place into a buffer with spare columns."""

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        add = key_states.shape[-2]
        start = self._offset_in_buffer()
        n = 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]
        if start is None or start + n + add > self._kbuf.shape[-2]:  # type: ignore[union-attr]
            self._adopt(key_states, value_states, n, add)
            start = 0
        assert self._kbuf is not None and self._vbuf is not None
        end = start + n + add
        self._kbuf[:, :, start + n:end].copy_(key_states)
        self._vbuf[:, :, start + n:end].copy_(value_states)
        self.keys = self._kbuf[:, :, start:end]
        self.values = self._vbuf[:, :, start:end]
        return self.keys, self.values

    def replace(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
        """Hold `keys` / `values` (`[rows, heads, length, dim]`, new tensors: rows selected or
        merged) in a fresh buffer with headroom (for `room` more columns at least), copied now;
        the old buffer is dropped at once rather than at the next update."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._kbuf = self._vbuf = None
        self.keys, self.values = keys, values
        if keys.shape[-2]:
            self._adopt(keys, values, keys.shape[-2], room)

    def widen_left(self, extra: int) -> bool:
        """Extend `keys` / `values` by `extra` leading columns inside the buffer, as a view.

        The columns gained are ones an earlier trim dropped: they hold earlier, finite keys and
        values, which the caller masks out. False (and nothing changed) when the cache is not a
        view of the buffer or too few columns lie before it."""
        start = self._offset_in_buffer()
        if start is None or start < extra:
            return False
        assert self.keys is not None and self._kbuf is not None and self._vbuf is not None
        end = start + self.keys.shape[-2]
        self.keys = self._kbuf[:, :, start - extra:end]
        self.values = self._vbuf[:, :, start - extra:end]
        return True

    def _offset_in_buffer(self) -> int | None:
        """The column where `keys` starts inside our buffer, or None if `keys` is not a
        leading-trimmed view of it (someone assigned new tensors, or nothing is cached)."""
        k, buf = self.keys, self._kbuf
        if buf is None or k is None or k.numel() == 0 or self.values is None:
            return None
        if (k.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
                or k.shape[:2] != buf.shape[:2] or k.stride() != buf.stride()
                or self.values.untyped_storage().data_ptr()
                != self._vbuf.untyped_storage().data_ptr()):  # type: ignore[union-attr]
            return None
        start, rem = divmod(int(k.storage_offset()) - int(buf.storage_offset()), buf.stride(2))
        return start if rem == 0 and self.values.storage_offset() == (
            self._vbuf.storage_offset() + start * buf.stride(2)) else None  # type: ignore[union-attr]

    def _adopt(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int,
               add: int) -> None:
        """Fresh buffers with room for the current `n` columns, `add` more and headroom."""
        rows, heads, _, dim = key_states.shape
        cap = n + add + min((n + add) // 2, GROW_MAX) + _SPARE
        kbuf = key_states.new_empty((rows, heads, cap, dim))
        vbuf = value_states.new_empty((rows, heads, cap, value_states.shape[-1]))
        if n:
            assert self.keys is not None and self.values is not None
            kbuf[:, :, :n].copy_(self.keys)
            vbuf[:, :, :n].copy_(self.values)
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


def growing_cache(config: Any) -> DynamicCache:
    """A `DynamicCache` for `config` whose layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache
