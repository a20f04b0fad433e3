"""Routing replay in the torch trainer: an MoE model's routers choose, for every token with a
record, the experts the engine's routers chose when the rollout was sampled.

Owns: a micro-batch's records as one tensor laid out like the model's input (`routes`: one row
per sequence, right-padded, or `shared_prefix.layout`'s runs, the shared prefix once), the
patched router forward (`Replay.routing`) and the count of (token, layer) pairs where the
trainer's own router would have chosen another set of experts. Does not own: the records
(`records.RoutedExperts`, made by the engines), whether replay is on
(`modeling.routing_replay`), or the log-probs (`lm_head`).

The replayed router, for a token with a record: its indices are the recorded ones, its
weights are the router's own softmax probabilities at those experts (renormalised over the k
when the model normalises its top-k). The router's weights therefore still get a gradient
through the weights of the experts the token used, as in verl's R3 and slime's rollout routing
replay. A token without a record (padding, SFT examples, the last sampled token) is routed by
the router as usual. Works for routers with transformers' `*TopKRouter` contract
(`modeling.routers`; tested on Qwen3-MoE).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.errors import TrainerError
from asyncrl.modeling import routers
from asyncrl.records import RoutedExperts


def _decode(rec: RoutedExperts | None, n: int, layers: int, top_k: int) -> torch.Tensor:
    """`rec` fitted to `n` tokens as `[n, layers, top_k]` long, -1 where nothing is recorded."""
    if rec is None:
        return torch.full((n, layers, top_k), -1, dtype=torch.long)
    if (rec.layers, rec.top_k) != (layers, top_k):
        raise TrainerError(f"routing record of {rec.layers} layers x top-{rec.top_k} for a "
                           f"model of {layers} sparse layers x top-{top_k}")
    fit = rec.fitted(n)
    arr = np.frombuffer(fit.data, dtype="<u1" if rec.itemsize == 1 else "<u2")
    out = torch.from_numpy(arr.astype(np.int64)).view(n, layers, top_k)
    return out.masked_fill_(out == rec.missing, -1)


def routes(records: Sequence[RoutedExperts | None], lengths: Sequence[int], width: int,
           shared: Sequence[int], layers: int, top_k: int, device: torch.device
           ) -> torch.Tensor:
    """Per position of what the model runs on, flattened row-major, the recorded experts:
    `[rows * columns, layers, top_k]` long, -1 where none. Without `shared` (empty) the rows
    are the sequences (`lengths`) right-padded to `width`; with it (`Packed.shared_prefix`),
    `shared_prefix.layout`'s runs: a run's first sequence whole, then each further sequence's
    tokens after its shared prefix."""
    recs = [_decode(r, n, layers, top_k) for r, n in zip(records, lengths, strict=True)]
    if shared:
        runs: list[list[torch.Tensor]] = []
        for rec, p in zip(recs, shared, strict=True):
            if p == 0:
                runs.append([rec])
            else:
                runs[-1].append(rec[p:])
        rows = [torch.cat(r) for r in runs]
        width = max(r.shape[0] for r in rows)
    else:
        rows = recs
    out = torch.full((len(rows), width, layers, top_k), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out.view(-1, layers, top_k).to(device)


class Replay:
    """Counts of replayed (token, layer) pairs and of those whose experts the trainer's own
    router would have changed, kept across the forwards of one step (`metrics` resets)."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.layers, self.top_k = layers, top_k
        self._counts: list[torch.Tensor] = []  # (changed, compared) per forward and layer

    @contextlib.contextmanager
    def routing(self, model: Any, recorded: torch.Tensor | None) -> Iterator[None]:
        """Within: `model`'s routers follow `recorded` (`routes`' tensor for the input the
        model runs on; None: no replay)."""
        if recorded is None:
            yield
            return
        mods = routers(model)
        if len(mods) != self.layers:
            raise TrainerError(f"{len(mods)} routers in the model for {self.layers} sparse "
                               "layers in its config: cannot replay routing")
        for i, m in enumerate(mods):
            m.forward = self._forward(m, recorded[:, i, :])
        try:
            yield
        finally:
            for m in mods:
                del m.forward

    def _forward(self, m: Any, rec: torch.Tensor) -> Any:
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden = hidden.reshape(-1, m.weight.shape[1])
            if hidden.shape[0] != rec.shape[0]:
                raise TrainerError(f"router input of {hidden.shape[0]} tokens, routing record "
                                   f"of {rec.shape[0]}: the layouts disagree")
            logits = F.linear(hidden, m.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, m.top_k, dim=-1).indices
            has = rec[:, :1] >= 0
            idx = torch.where(has, rec, own)
            weights = probs.gather(1, idx)
            if getattr(m, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            with torch.no_grad():  # on the device: no host sync inside the forward
                differs = (own.sort(dim=-1).values != idx.sort(dim=-1).values).any(dim=-1)
                self._counts.append(torch.stack([(differs & has[:, 0]).sum(), has.sum()]))
            return logits, weights.to(logits.dtype), idx

        return forward

    def metrics(self, prefix: str = "train/") -> dict[str, float]:
        """`routing_replay_changed`: the share of replayed (token, layer) pairs whose experts
        the trainer's own router would have chosen otherwise; `routing_replay_tokens`: how many
        pairs were replayed (over every rank and every forward of the step). Resets."""
        counts = (torch.stack(self._counts).sum(dim=0).double() if self._counts
                  else torch.zeros(2, dtype=torch.float64))
        self._counts = []
        return replay_metrics(counts, prefix)


def replay_metrics(counts: torch.Tensor, prefix: str) -> dict[str, float]:
    """(changed, replayed) pairs of this rank, summed over every rank, as the step's metrics
    (none when nothing was replayed). Collective when torch.distributed runs several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        counts = counts.to(dev)
        dist.all_reduce(counts)
    changed, compared = (float(x) for x in counts.cpu())
    if not compared:
        return {}
    return {f"{prefix}routing_replay_changed": changed / compared,
            f"{prefix}routing_replay_tokens": compared}
