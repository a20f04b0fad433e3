"""Batched next-token sampling on the model's device, for the local engine.

Owns: turning one step's last-position logits `[B, V]` into one token and its log-prob per row,
with per-row temperature (0 = greedy), top-p and optional per-request seed, in a handful of
whole-batch tensor ops, and one small device->host copy (ids and log-probs, never the logits).
Does not own: stop rules or which rows are in the batch (the engine).

Method: inverse-CDF sampling. Each sampled row draws one uniform `u` in [0, 1); the token is the
first index whose cumulative probability exceeds `u` times the row's total (top-p rows: in
probability-sorted order over the nucleus). That is exactly a draw from the row's categorical
distribution, with one random number per row instead of one per vocabulary entry. Rows without
top-p find it in two levels: the vocabulary is cut into ~sqrt(V) blocks, one pass sums each
block (the row's total is the sum of those), the block comes from the short running sum over
blocks and the token from a running sum inside that one block, so no `[B, V]` running sum is
ever written. At V = 151,936 a step then makes four passes over the logits (max, subtract,
exp, block sums) where the one-level method made six.

Log-probs follow the engine protocol: the sampled token's log-probability under the
temperature-scaled distribution before top-p truncation (greedy rows: temperature 1);
non-finite values are reported as -1e30.

Seeds. A request with a seed owns a CPU `torch.Generator` and draws exactly one uniform from it
per sampled token, so its token sequence depends only on its seed and its own logits: the same
request gives the same tokens whichever other requests share its batches, up to the float
differences batching makes in the logits themselves (summation order; exact on ties only by
chance). Unseeded rows draw their uniforms together from the engine's generator (reproducible
for a whole run only when the same requests arrive in the same order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

NEG_LOGPROB = -1e30


def sample_rows(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                generators: Sequence[Any], default: torch.Generator
                ) -> tuple[list[int], list[float]]:
    """One token and its log-prob per row of `logits` (`[B, V]`, any float dtype, any device).

    `temperatures[i] == 0` is greedy; `top_ps[i]` in (0, 1]; `generators[i]` a CPU generator or
    None (then `default` is used). Returns Python lists (one device->host copy)."""
    dev = logits.device
    rows, vocab = logits.shape
    temps = torch.tensor(temperatures, dtype=torch.float32)
    greedy = temps == 0
    x = logits.float()
    scale = torch.where(greedy, 1.0, temps)
    if bool((scale != 1.0).any()):  # the usual RL batch (temperature 1.0) skips this pass
        x = x / scale.to(dev).unsqueeze(1)
    # Passes over [B, V]: max (also the greedy tokens), subtract, exp, block sums. The log-prob
    # of a token is x[token] - (max + log(total)), without a [B, V] log-softmax.
    top, toks = x.max(dim=-1, keepdim=True)
    e = (x - top).exp_()
    size = max(1, math.isqrt(vocab))
    blocks = _block_sums(e, size)
    block_cdf = blocks.cumsum_(dim=-1)
    total = block_cdf[:, -1:]
    sampled = (~greedy).nonzero().squeeze(1).tolist()
    if sampled:
        s_rows = torch.tensor(sampled, device=dev)
        u = _uniforms([generators[i] for i in sampled], default).to(dev)
        nucleus = torch.tensor([top_ps[i] for i in sampled], dtype=torch.float32)
        every = len(sampled) == rows
        if bool((nucleus < 1.0).any()):
            probs = e if every else e.index_select(0, s_rows)
            picked = _sample_top_p(probs / total.index_select(0, s_rows), nucleus.to(dev), u)
        else:
            cdf = block_cdf if every else block_cdf.index_select(0, s_rows)
            picked = _pick_blocked(e if every else e.index_select(0, s_rows), cdf, size, u)
        toks[s_rows] = picked.unsqueeze(1)
    lps = (x.gather(1, toks) - top - total.log()).squeeze(1)
    lps = torch.where(torch.isfinite(lps), lps, NEG_LOGPROB)
    host = torch.stack([toks.squeeze(1).to(torch.float64), lps.to(torch.float64)]).cpu()
    return [int(t) for t in host[0].tolist()], host[1].tolist()


def _uniforms(generators: Sequence[Any], default: torch.Generator) -> torch.Tensor:
    """One uniform per row: seeded rows from their own generator, the rest in one draw."""
    u = torch.rand(len(generators), generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)
    return u


def _block_sums(e: torch.Tensor, size: int) -> torch.Tensor:
    """`[B, ceil(V / size)]`: the sum of each run of `size` entries (the last run may be short)."""
    full = e.shape[1] // size * size
    sums = e[:, :full].reshape(e.shape[0], -1, size).sum(dim=-1)
    if full < e.shape[1]:
        sums = torch.cat([sums, e[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    return sums


def _pick(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass exceeds `u` times the row's total, never an index of
    zero mass (rounding can put the target on or past the total: then the last massive one)."""
    # right=True: a zero-mass entry (cdf equal to its predecessor's) is never picked.
    last = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.unsqueeze(1) * last, right=True)
    return torch.minimum(idx, (cdf < last).sum(dim=1, keepdim=True)).squeeze(1)


def _pick_blocked(e: torch.Tensor, block_cdf: torch.Tensor, size: int,
                  u: torch.Tensor) -> torch.Tensor:
    """`_pick` over the running sum of `e`, found through the block running sum: the block first,
    then the entry inside it."""
    block = _pick(block_cdf, u)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1))
                         .squeeze(1), 0.0)
    start = block * size
    cols = (start.unsqueeze(1) + torch.arange(size, device=e.device)).clamp_(max=e.shape[1] - 1)
    inside = e.gather(1, cols)
    inside[cols < start.unsqueeze(1) + torch.arange(size, device=e.device)] = 0.0  # past V
    cdf = inside.cumsum_(dim=-1)
    share = ((u * block_cdf[:, -1] - before) / cdf[:, -1]).clamp_(0.0, 1.0)
    return start + _pick(cdf, share)


def _sample_top_p(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample within the nucleus: the most probable tokens whose mass before each reaches
    `top_p` (the first token is always kept)."""
    sp, si = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(dim=-1) - sp
    limit = torch.where(top_p < 1.0, top_p, torch.inf)  # top_p = 1 rows keep every token
    sp.masked_fill_(before >= limit.unsqueeze(1), 0.0)
    return si.gather(1, _pick(sp.cumsum_(dim=-1), u).unsqueeze(1)).squeeze(1)
