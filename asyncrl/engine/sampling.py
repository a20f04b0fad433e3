"""Batched next-token sampling on the model's device, for the local engine.

Owns: turning one step's last-position logits `[B, V]` into one token and its log-prob per row,
with per-row temperature (0 = greedy), top-p and optional per-request seed, in a handful of
whole-batch tensor ops, and one small device->host copy (ids and log-probs, never the logits).
Does not own: stop rules or which rows are in the batch (the engine).

Method: inverse-CDF sampling. Each sampled row draws one uniform `u` in [0, 1); the token is the
first index whose cumulative probability exceeds `u` times the row's total (top-p rows: in
probability-sorted order over the nucleus). That is exactly a draw from the row's categorical
distribution, with one random number per row instead of one per vocabulary entry.

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
    temps = torch.tensor(temperatures, dtype=torch.float32)
    greedy = temps == 0
    x = logits.float()
    if not bool(greedy.all()):
        x = x / torch.where(greedy, 1.0, temps).to(dev).unsqueeze(1)
    # One pass for the max (and the greedy tokens), one for exp, one for the (pairwise, exact)
    # sum; the log-prob of a token is x[token] - (max + log(sum)), without a [B, V]
    # log-softmax. Sampled rows add one running-sum pass to pick their token.
    top, toks = x.max(dim=-1, keepdim=True)
    e = (x - top).exp_()
    total = e.sum(dim=-1, keepdim=True)
    sampled = (~greedy).nonzero().squeeze(1).tolist()
    if sampled:
        s_rows = torch.tensor(sampled, device=dev)
        u = _uniforms([generators[i] for i in sampled], default).to(dev)
        nucleus = torch.tensor([top_ps[i] for i in sampled], dtype=torch.float32)
        probs = e if len(sampled) == e.shape[0] else e.index_select(0, s_rows)
        if bool((nucleus < 1.0).any()):
            picked = _sample_top_p(probs / total.index_select(0, s_rows), nucleus.to(dev), u)
        else:
            picked = _pick(probs.cumsum_(dim=-1), u)
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


def _pick(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass exceeds `u` times the row's total."""
    # right=True: a zero-probability token (cdf equal to its predecessor's) is never picked.
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return idx.clamp_(max=cdf.shape[1] - 1)


def _sample_top_p(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample within the nucleus: the most probable tokens whose mass before each reaches
    `top_p` (the first token is always kept)."""
    sp, si = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(dim=-1) - sp
    limit = torch.where(top_p < 1.0, top_p, torch.inf)  # top_p = 1 rows keep every token
    sp.masked_fill_(before >= limit.unsqueeze(1), 0.0)
    return si.gather(1, _pick(sp.cumsum_(dim=-1), u).unsqueeze(1)).squeeze(1)
