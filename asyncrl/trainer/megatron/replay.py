"""Routing replay in the Megatron trainer, through megatron-core's own router replay
(`megatron/core/transformer/moe/router_replay.py`, on with `moe_enable_routing_replay`).

Owns: handing each MoE layer's `RouterReplay` the recorded experts of a micro-batch in
megatron's token order, and the count of (token, layer) pairs whose experts the trainer's
router would have changed (`train/routing_replay_changed`, as the torch trainer reports it).
Does not own: the records (`records.RoutedExperts`) or their layout in `[B, T]` rows
(`asyncrl.trainer.moe_replay.routes`, shared with the torch trainer).

megatron-core's replay takes a target `[tokens, top_k]` per layer and gathers the router's
scores at it (`REPLAY_FORWARD`); its target must name every token. A rollout's record has
holes (padding, the last sampled token: -1), so each layer's `get_replay_topk` is wrapped:
megatron's own top-k first, the recorded experts wherever there is a record, and the scores
gathered there, which is what `REPLAY_FORWARD` does for a full record. The target stays set
until the next micro-batch's forward, so a recomputed forward in the backward
(`trainer.recompute`) routes the same way. Tokens are ordered as megatron flattens its
`[s, b, h]` hidden states: position-major. One per model: the trainer keeps one for its
policy and one for its frozen reference (`algorithm.kl_coef`), each set before that model's
forward, so both route the recorded experts.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.errors import TrainerError


class MegatronReplay:
    """The routers of one `GPTModel` (built with `moe_enable_routing_replay`)."""

    def __init__(self, model: Any) -> None:
        layers = getattr(getattr(model, "decoder", None), "layers", [])
        self._replays = [layer.mlp.router.router_replay for layer in layers]
        if not self._replays or any(r is None for r in self._replays):
            raise TrainerError("routing replay needs a MoE GPTModel built with "
                               "moe_enable_routing_replay")
        self._targets: list[torch.Tensor | None] = [None] * len(self._replays)
        self._counts: list[torch.Tensor] = []
        for i, r in enumerate(self._replays):
            r.get_replay_topk = self._topk(i)

    def set(self, routes: torch.Tensor | None, rows: int, width: int) -> None:
        """The records of the next forward: `routes` `[rows * width, layers, top_k]` in
        row-major `[B, T]` order (None: the router decides everywhere)."""
        if routes is None:
            self._targets = [None] * len(self._replays)
            return
        by_pos = routes.view(rows, width, len(self._replays), -1).transpose(0, 1)
        self._targets = [by_pos[:, :, i].reshape(rows * width, -1)
                         for i in range(len(self._replays))]

    def _topk(self, i: int) -> Any:
        def get_replay_topk(scores: torch.Tensor, topk: int, num_groups: Any = None,
                            group_topk: Any = None, default_compute_topk: Any = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
            target = self._targets[i]
            if target is None:
                return probs, own
            if target.shape[0] != scores.shape[0]:
                raise TrainerError(f"router input of {scores.shape[0]} tokens, routing "
                                   f"record of {target.shape[0]}")
            target = target.to(scores.device)
            has = target[:, :1] >= 0
            idx = torch.where(has, target, own)
            with torch.no_grad():
                differs = (own.sort(dim=-1).values != idx.sort(dim=-1).values).any(dim=-1)
                self._counts.append(torch.stack([(differs & has[:, 0]).sum(), has.sum()]))
            return scores.gather(1, idx), idx

        return get_replay_topk

    def take_counts(self) -> torch.Tensor:
        """(changed, replayed) (token, layer) pairs since the last call, float64."""
        out = (torch.stack(self._counts).sum(dim=0).double().cpu() if self._counts
               else torch.zeros(2, dtype=torch.float64))
        self._counts = []
        return out
