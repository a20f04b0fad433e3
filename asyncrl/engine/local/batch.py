"""The local engine's running batch: one left-padded KV cache shared by all its rows.

Owns: the batch cache (`kvcache.GrowingLayer`s), its 2-D attention mask and each row's next
position, and the row operations the engine's worker thread applies between forwards: free a
row (it stays, dead: mask cleared, position 0), trim leading columns no row attends to (a
view), write freshly prefilled rows into dead rows right-aligned (widening by taking trimmed
columns back, a view, when the buffers allow), append rows (a copy), compact to the live rows
(a copy). Does not own: which request is in which row, or when rows move (the engine's plan),
nor the model forward.

Invariants: `mask` is `[rows, width]` with 1 where a row has a real token; `pos[r]` is the
position id of row r's next token; every layer's keys / values are `[rows, heads, width, dim]`
and finite everywhere (masked columns hold earlier, finite values), so a row that attends to
nothing real still computes finite outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class BatchCache:
    """See the module docstring. Empty (`rows == 0`, no cache) until rows are appended."""

    def __init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        self.cache: Any = None
        self.mask: Any = None
        self.pos: Any = None
        self.rows = 0

    def free(self, rows: list[int]) -> None:
        """Rows whose request left: from now on they attend only to their own dummy tokens."""
        idx = torch.tensor(rows, device=self.mask.device)
        self.mask[idx] = 0
        self.pos[idx] = 0

    def row_kv(self, row: int, n: int) -> list[tuple[Any, Any]]:
        """Per layer, copies of row `row`'s last `n` keys and values (`[heads, n, dim]`): a
        live row's whole context, which ends at the last column."""
        return [(layer.keys[row, :, -n:].clone(), layer.values[row, :, -n:].clone())
                for layer in self.cache.layers]

    def begin_decode(self) -> None:
        """One more column, attended by every row (a dead row's dummy token lands there too)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)

    def compact(self, keep: list[int]) -> None:
        """Keep only `keep` rows, in that order (one copy of the cache); none: empty."""
        if not keep:
            self._empty()
            return
        idx = torch.tensor(keep, device=self.mask.device)
        for layer in self.cache.layers:
            _replace(layer, layer.keys.index_select(0, idx), layer.values.index_select(0, idx))
        self.mask = self.mask.index_select(0, idx)
        self.pos = self.pos.index_select(0, idx)
        self.rows = len(keep)

    def trim(self) -> None:
        """Drop leading columns no row attends to (a view: nothing is copied)."""
        if self.rows == 0:
            return
        first = int(self.mask.any(dim=0).int().argmax())
        if first > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]
            self.mask = self.mask[:, first:]

    def fill(self, rows: list[int], cache: Any, lens: list[int], src: list[int]) -> None:
        """Write rows `src` of a freshly prefilled, left-padded `cache` (real lengths `lens`)
        into the dead rows `rows`, right-aligned with the batch (one source row may go to
        several rows: requests with the same context)."""
        width = self.mask.shape[1]
        if max(lens) > width:
            self._widen(max(lens) - width)
            width = self.mask.shape[1]
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            n = new.keys.shape[2]
            for r, i, ln in zip(rows, src, lens, strict=True):
                old.keys[r, :, width - ln:] = new.keys[i, :, n - ln:]
                old.values[r, :, width - ln:] = new.values[i, :, n - ln:]
        for r, ln in zip(rows, lens, strict=True):
            self.mask[r] = 0
            self.mask[r, width - ln:] = 1
            self.pos[r] = ln

    def append(self, cache: Any, mask: Any, pos: Any) -> None:
        """Freshly prefilled rows (`cache`, its mask, next positions) after the existing ones,
        left-padding the narrower side (a copy of the cache; an empty batch adopts them)."""
        if self.rows == 0:
            self.cache, self.mask, self.pos, self.rows = cache, mask, pos, mask.shape[0]
            return
        lo, ln = self.mask.shape[1], mask.shape[1]
        width = max(lo, ln)
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            _replace(old, torch.cat([F.pad(old.keys, (0, 0, width - lo, 0)),
                                     F.pad(new.keys, (0, 0, width - ln, 0))], dim=0),
                     torch.cat([F.pad(old.values, (0, 0, width - lo, 0)),
                                F.pad(new.values, (0, 0, width - ln, 0))], dim=0))
            new.reset()  # the prefill's buffers go now, layer by layer
        self.mask = torch.cat([F.pad(self.mask, (width - lo, 0)), F.pad(mask, (width - ln, 0))])
        self.pos = torch.cat([self.pos, pos])
        self.rows += mask.shape[0]

    def _widen(self, extra: int) -> None:
        """`extra` more leading columns, masked out for every row."""
        for layer in self.cache.layers:
            if not layer.widen_left(extra):
                _replace(layer, F.pad(layer.keys, (0, 0, extra, 0)),
                         F.pad(layer.values, (0, 0, extra, 0)))
        self.mask = F.pad(self.mask, (extra, 0))


def _replace(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """New tensors for one layer: a `kvcache.GrowingLayer` copies them into a fresh buffer and
    drops its old one now (not at the next decode step, when every layer's old buffer would
    still be alive beside its replacement); another layer takes them as they are."""
    if hasattr(layer, "replace"):
        layer.replace(keys, values)
    else:
        layer.keys, layer.values = keys, values
