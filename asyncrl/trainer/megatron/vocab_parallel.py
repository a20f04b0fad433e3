"""Token log-probabilities and entropy from logits whose vocabulary is split over TP ranks.

Owns: the Megatron counterparts of `asyncrl.algo.loss.token_logprobs` and `token_entropy`,
with the same alignment (position t holds the value for predicting token t from tokens < t;
position 0 is 0) and the same temperature rule (logits divided by the sampling temperature).
The vocabulary dimension is never gathered: log-probs and entropy take one all-reduce of the
maxima and one of the sums (with the target logits and the entropy's partial sums), chunked like
`asyncrl.algo.loss.token_logprobs_and_entropy`, never a float32 copy of the whole logits.

Every TP rank of a group gets the same (replicated) result. Does not own the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.algo.loss import CHUNK_ELEMENTS, chunk_softmax_stats, position_spans


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """`[B, T]` float32 logprobs, differentiable. `logits` is `[B, T, V/tp]`; it is not
    modified, and no float32 copy of it is made: `_VocabParallelLogprob` works through chunks
    of positions (`asyncrl.algo.loss`'s chunk size), with two all-reductions over the TP group
    for the whole tensor (max, then sum-of-exp with the target logit)."""
    return _chunked(logits, input_ids, temperature, chunk, entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor,
                               temperature: float = 1.0, chunk: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy of the same tempered distributions from the same chunked
    pass (`asyncrl.algo.loss.token_logprobs_and_entropy`'s contract: entropy is a metric, no
    gradient). The entropy's partial sums ride in the same SUM all-reduce as the log-probs'."""
    return _chunked(logits, input_ids, temperature, chunk, entropy=True)


def _chunked(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
             chunk: int | None, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[1]
    if t < 2:  # nothing to predict; still a graph node, so a dummy micro-batch can backward
        zero = logits[..., 0].float() * 0.0
        return zero, zero.detach().clone()
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    lp, ent = _VocabParallelLogprob.apply(logits, input_ids[:, 1:], float(temperature), chunk,
                                          entropy)
    return F.pad(lp, (1, 0)), (F.pad(ent, (1, 0)) if entropy else ent)


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(x / T)[target] over a vocabulary split across the TP group, for the first
    T - 1 positions of `[B, T, V/tp]` logits, and when asked the entropy of that softmax (a
    non-differentiable second output; empty when not asked). Forward: per chunk
    (`asyncrl.algo.loss.chunk_softmax_stats`), the local max, the local sum of exp relative to
    it (and of exp * shifted logit for the entropy), and the target's logit where this rank
    holds it; then one MAX all-reduce of the maxima and one SUM all-reduce of the sums rescaled
    to the global max and the target logits. Backward needs no communication: each rank's
    gradient is (onehot - softmax) * g / T over its own slice, with the global log-sum-exp saved
    by forward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        part = logits.shape[-1]
        lo = ps.get_tensor_model_parallel_rank() * part
        b, t = targets.shape
        dev = logits.device
        local_max = torch.empty(b, t, dtype=torch.float32, device=dev)
        local_sum = torch.empty(b, t, dtype=torch.float32, device=dev)
        local_ez = torch.empty(b, t if entropy else 0, dtype=torch.float32, device=dev)
        picked = torch.zeros(b, t, dtype=torch.float32, device=dev)
        local_t = targets - lo
        owned = (local_t >= 0) & (local_t < part)
        local_t = torch.where(owned, local_t, 0)
        for i, s, e in position_spans(b, t, chunk):
            lg = logits[i, s:e].float()
            if temperature != 1.0:
                lg = lg / temperature
            z, m, total, ez = chunk_softmax_stats(lg, entropy)
            local_max[i, s:e] = m
            local_sum[i, s:e] = total
            if ez is not None:
                local_ez[i, s:e] = ez
            tl = z.gather(1, local_t[i, s:e].unsqueeze(1)).squeeze(1) + m
            picked[i, s:e] = torch.where(owned[i, s:e], tl, 0.0)
        gmax = local_max.clone()
        if tp > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        # Relative to the global max: z' = z + d with d = local max - global max, exp(z') =
        # exp(z) exp(d), so sum exp(z') = exp(d) sum and sum exp(z') z' = exp(d) (ez + d sum).
        d = local_max - gmax
        scale = d.exp()
        parts = [local_sum * scale, picked]
        if entropy:
            parts.append(scale * (local_ez + d * local_sum))
        sums = torch.stack(parts)
        if tp > 1:
            dist.all_reduce(sums, group=group)
        log_total = sums[0].log()
        lse = gmax + log_total
        ent = (log_total - sums[2] / sums[0]) if entropy else local_ez
        ctx.save_for_backward(logits, local_t, owned, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return sums[1] - lse, ent

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_ent: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        logits, local_t, owned, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        b, t = local_t.shape
        g = grad_out.float() / temperature
        grad = torch.zeros_like(logits)
        for i, s, e in position_spans(b, t, chunk):
            lg = logits[i, s:e].float()
            if temperature != 1.0:
                lg = lg / temperature
            gi = g[i, s:e].unsqueeze(1)
            soft = (lg - lse[i, s:e].unsqueeze(1)).exp_().mul_(-gi)
            soft.scatter_add_(1, local_t[i, s:e].unsqueeze(1), gi * owned[i, s:e].unsqueeze(1))
            grad[i, s:e] = soft
        return grad, None, None, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0,
                  chunk: int | None = None) -> torch.Tensor:
    """`[B, T]` float32 entropy of the (tempered) distribution predicting token t; no gradient.
    The entropy half of `token_logprobs_and_entropy` (same chunks, same collectives)."""
    targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, targets, temperature, chunk)[1]
