"""Token log-probabilities and entropy from logits whose vocabulary is split over TP ranks.

Owns: the Megatron counterparts of `asyncrl.algo.loss.token_logprobs` and `token_entropy`,
with the same alignment (position t holds the value for predicting token t from tokens < t;
position 0 is 0) and the same temperature rule (logits divided by the sampling temperature).
The vocabulary dimension is never gathered: the log-probs take one all-reduce of the maxima and
one of the sums (and target logits), chunked like `asyncrl.algo.loss.token_logprobs`; the
entropy needs one more sum.

Every TP rank of a group gets the same (replicated) result. Does not own the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.algo.loss import CHUNK_ELEMENTS, position_spans


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """`[B, T]` float32 logprobs, differentiable. `logits` is `[B, T, V/tp]`; it is not
    modified, and no float32 copy of it is made: `_VocabParallelLogprob` works through chunks
    of positions (`asyncrl.algo.loss`'s chunk size), with two all-reductions over the TP group
    for the whole tensor (max, then sum-of-exp with the target logit)."""
    t = logits.shape[1]
    if t < 2:  # nothing to predict; still a graph node, so a dummy micro-batch can backward
        return logits[..., 0].float() * 0.0
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    lp = _VocabParallelLogprob.apply(logits, input_ids[:, 1:], float(temperature), chunk)
    return F.pad(lp, (1, 0))


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(x / T)[target] over a vocabulary split across the TP group, for the first
    T - 1 positions of `[B, T, V/tp]` logits. Forward: per chunk, the local max and the local
    sum of exp relative to it, and the target's logit where this rank holds it; then one MAX
    all-reduce of the maxima and one SUM all-reduce of the rescaled sums and target logits.
    Backward needs no communication: each rank's gradient is (onehot - softmax) * g / T over its
    own slice, with the global log-sum-exp saved by forward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        part = logits.shape[-1]
        lo = ps.get_tensor_model_parallel_rank() * part
        b, t = targets.shape
        dev = logits.device
        local_max = torch.empty(b, t, dtype=torch.float32, device=dev)
        local_sum = torch.empty(b, t, dtype=torch.float32, device=dev)
        picked = torch.zeros(b, t, dtype=torch.float32, device=dev)
        local_t = targets - lo
        owned = (local_t >= 0) & (local_t < part)
        local_t = torch.where(owned, local_t, 0)
        for i, s, e in position_spans(b, t, chunk):
            lg = logits[i, s:e].float()
            if temperature != 1.0:
                lg = lg / temperature
            m = lg.amax(dim=-1)
            local_max[i, s:e] = m
            local_sum[i, s:e] = (lg - m.unsqueeze(1)).exp_().sum(dim=-1)
            tl = lg.gather(1, local_t[i, s:e].unsqueeze(1)).squeeze(1)
            picked[i, s:e] = torch.where(owned[i, s:e], tl, 0.0)
        gmax = local_max.clone()
        if tp > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([local_sum * (local_max - gmax).exp(), picked])
        if tp > 1:
            dist.all_reduce(sums, group=group)
        lse = gmax + sums[0].log()
        ctx.save_for_backward(logits, local_t, owned, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return sums[1] - lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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
        return grad, None, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 1024) -> torch.Tensor:
    """`[B, T]` float32 entropy of the (tempered) distribution predicting token t; no gradient.
    Chunked over positions to bound memory."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    b, t, _ = logits.shape
    out = torch.zeros(b, t, dtype=torch.float32, device=logits.device)
    for s in range(0, t - 1, chunk):
        lg = logits[:, s:min(s + chunk, t - 1)].float() / temperature
        m = lg.amax(dim=-1)
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = lg - m.unsqueeze(-1)
        e = z.exp()
        sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
        if tp > 1:
            dist.all_reduce(sums, group=group)
        out[:, s + 1:s + 1 + lg.shape[1]] = sums[0].log() - sums[1] / sums[0]
    return out
