"""Token log-probabilities and entropy from logits whose vocabulary is split over TP ranks.

Owns: the Megatron counterparts of `asyncrl.algo.loss.token_logprobs` and `token_entropy`,
with the same alignment (position t holds the value for predicting token t from tokens < t;
position 0 is 0) and the same temperature rule (logits divided by the sampling temperature).
The vocabulary dimension is never gathered: megatron-core's vocab-parallel cross entropy gives
-log p with one all-reduce of max and sum; the entropy needs one more sum.

Every TP rank of a group gets the same (replicated) result. Does not own the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """`[B, T]` float32 logprobs, differentiable. `logits` is `[B, T, V/tp]`; it is not
    modified (megatron's kernel works in place on its own float copy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    lg = logits[:, :-1].float()
    if temperature != 1.0:
        lg = lg / temperature
    elif logits.dtype == torch.float32:
        lg = lg.clone()  # `.float()` did not copy, and the kernel subtracts the max in place
    nll = vocab_parallel_cross_entropy(lg.contiguous(), input_ids[:, 1:].contiguous())
    return F.pad(-nll, (1, 0))


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
