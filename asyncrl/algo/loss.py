"""The GRPO policy loss and its metrics, in torch, shared by every trainer.

Owns: per-token logprobs and entropy from logits (one chunked pass, no float32 copy of the
whole `[B, T, V]` logits; `row_logprobs` for logits taken at chosen positions only), the
clipped-ratio loss with clip-higher and dual-clip (`grpo_loss`), the masked cross-entropy of
the SFT cold start (`sft_loss`), the trainer/sampler mismatch metrics, and `StepStats`, which
sums metrics over micro-batches and data-parallel ranks. Does not own: models, optimizers or
how sequences are packed.

Conventions: tensors are `[batch, time]`, position t holds token t (see `batching`); `mask` is
1 where token t is trained (model tokens of the response) and 0 for prompt, tool-output,
padding and dummy tokens. Masked positions contribute exactly zero loss and zero gradient.

Token-mean over the batch: the loss of a micro-batch is `sum(per-token loss * mask) /
normalizer`, where `normalizer` is the number of trained tokens in the whole mini-batch (all
micro-batches, all ranks). Summing the micro-batch losses therefore gives the token-mean of the
mini-batch, whatever the packing. No entropy bonus (entropy is only measured); a KL penalty to a
reference policy only when asked (`kl_penalty`, `algorithm.kl_coef`; off in the report).

Per-token loss with ratio r = exp(logp - old_logp) and advantage A (DAPO's clip-higher and the
dual-clip of Ye et al. 2020, as in verl):
- `clipped = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))`
- A >= 0: `clipped`. A < 0: `min(clipped, -A * dual_clip)`, i.e. the loss of a negative token
  never exceeds `dual_clip * |A|`, however large r grows.

Metric names: `tokens` (trained tokens), `<name>_sum` (token sums; `StepStats.means` divides
them by `tokens` and drops the suffix), `<name>_max` / `<name>_min` (extremes).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

Metrics = dict[str, torch.Tensor]


CHUNK_ELEMENTS = 1 << 24
"""Float32 elements of one log-prob chunk (64 MiB): ~110 positions of a 151,936-token vocabulary."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    """Logprob of token t given tokens < t, at position t; position 0 is 0. `[B, T]`, float32.

    `temperature` divides the logits first, to match an engine that sampled at that temperature.
    Differentiable. Computed `chunk` positions at a time (default: `CHUNK_ELEMENTS` floats
    per chunk), forward and backward
    (`_ChunkedLogprob`), so no float32 copy of the whole `[B, T, V]` logits is ever made: with a
    151,936-token vocabulary that copy (and the log-softmax and gradient beside it) was the
    largest tensor of a step.
    """
    return _chunked(logits, input_ids, temperature, chunk, entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor,
                               temperature: float = 1.0, chunk: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and, from the same chunked pass over the logits, the entropy of the
    (tempered) distribution that predicted token t, at position t (0 at position 0).

    Both `[B, T]` float32. The log-probs carry the gradient; the entropy is a metric only (the
    loss has no entropy bonus) and carries none. Costs one more multiply-sum per chunk instead
    of a second pass with its own float32 copies of the logits.
    """
    return _chunked(logits, input_ids, temperature, chunk, entropy=True)


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 chunk: int | None = None, entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `[N, V]` logits, the log-prob of `targets[n]` under `logits[n] / temperature`
    and, when `entropy`, the entropy of that distribution (no gradient; empty when not asked).
    Both `[N]` float32. The same chunked pass as `token_logprobs`, for logits computed only at
    the positions that are read (`asyncrl.trainer.lm_head`); N may be 0 (the result is still a
    graph node, so a micro-batch with nothing to train can backward)."""
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    lp, ent = _ChunkedLogprob.apply(logits.unsqueeze(0), targets.unsqueeze(0),
                                    float(temperature), chunk, entropy)
    return lp[0], ent[0]


def _chunked(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
             chunk: int | None, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[1]
    if t < 2:  # nothing to predict; still a graph node, so a dummy micro-batch can backward
        zero = logits[..., 0].float() * 0.0
        return zero, zero.detach().clone()
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    lp, ent = _ChunkedLogprob.apply(logits, input_ids[:, 1:], float(temperature), chunk,
                                    entropy)
    return F.pad(lp, (1, 0)), (F.pad(ent, (1, 0)) if entropy else ent)


def position_spans(b: int, t: int, chunk: int) -> list[tuple[int, int, int]]:
    """(row, start, end) position spans of at most `chunk` over `b` rows of `t` positions."""
    return [(i, s, min(s + chunk, t)) for i in range(b) for s in range(0, t, chunk)]


def chunk_softmax_stats(lg: torch.Tensor, entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For float32 logits `lg` `[n, V]` (not modified): (shifted logits `lg - max`, the max,
    the sum of exp of the shifted logits, and when asked the sum of `exp(z) * z`), the pieces
    from which log-sum-exp (`max + log sum`), a target's log-prob (`z[target] - log sum`) and the
    entropy (`log sum - sum(exp(z) z) / sum`) follow; over a vocabulary split across ranks the
    sums are first rescaled to a common max and added up."""
    m = lg.amax(dim=-1)
    z = lg - m.unsqueeze(1)
    e = z.exp()
    total = e.sum(dim=-1)
    ez = e.mul_(z).sum(dim=-1) if entropy else None
    return z, m, total, ez


class _ChunkedLogprob(torch.autograd.Function):
    """log softmax(x / temperature)[target] for the first `targets.shape[1]` positions of
    `[B, T, V]` logits (T - 1 for whole sequences, whose last position predicts nothing; all T
    for `row_logprobs`'s gathered rows), a chunk of positions of one row at a time in
    float32 (each a contiguous slice: nothing of the whole tensor is copied), and, when asked,
    the entropy of the same softmax from the same chunk (a second, non-differentiable output;
    empty when not asked). Backward recomputes each chunk's softmax from the saved log-sum-exp
    and writes the gradient in the logits' own dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = targets.shape
        dev = logits.device
        lse = torch.empty(b, t, dtype=torch.float32, device=dev)
        out = torch.empty(b, t, dtype=torch.float32, device=dev)
        ent = torch.empty(b, t if entropy else 0, dtype=torch.float32, device=dev)
        for i, s, e in position_spans(b, t, chunk):
            lg = logits[i, s:e].float()
            if temperature != 1.0:
                lg = lg / temperature
            z, m, total, ez = chunk_softmax_stats(lg, entropy)
            log_total = total.log()
            lse[i, s:e] = m + log_total
            out[i, s:e] = z.gather(1, targets[i, s:e].unsqueeze(1)).squeeze(1) - log_total
            if ez is not None:
                ent[i, s:e] = log_total - ez / total
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_ent: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        logits, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        b, t = targets.shape
        g = grad_out.float() / temperature
        grad = torch.zeros_like(logits)
        for i, s, e in position_spans(b, t, chunk):
            lg = logits[i, s:e].float()
            if temperature != 1.0:
                lg = lg / temperature
            # d logp[target] / d x = (onehot(target) - softmax(x / T)) / T
            gi = g[i, s:e].unsqueeze(1)
            soft = (lg - lse[i, s:e].unsqueeze(1)).exp_().mul_(-gi)
            soft.scatter_add_(1, targets[i, s:e].unsqueeze(1), gi)
            grad[i, s:e] = soft
        return grad, None, None, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Entropy of the distribution that predicted token t, at position t (0 at position 0).
    `[B, T]`, float32, no gradient; the entropy half of `token_logprobs_and_entropy` (same
    chunks). Trainers take both from one pass; this serves callers that need only entropy."""
    targets = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, targets, 1.0, chunk)[1]


def _normalizer(mask: torch.Tensor, normalizer: float | torch.Tensor | None) -> torch.Tensor:
    if normalizer is None:
        return mask.sum().clamp(min=1.0)
    return torch.as_tensor(normalizer, dtype=torch.float32, device=mask.device)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float,
              normalizer: float | torch.Tensor | None = None,
              coef: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The GRPO-RoC policy loss of one micro-batch and its metric sums (see the module doc).

    `coef` (detached, `[B, T]`): a per-token off-policy correction that multiplies each
    token's clipped loss (`algo.offpolicy.correction_coef`); None = 1 everywhere.

    `logprobs` carries the gradient; `old_logprobs` (the trainer's recomputation before the
    update) is treated as a constant. `advantages` is per token or broadcastable to it.
    `normalizer` is the trained-token count of the whole mini-batch; None uses this call's mask
    (a plain token-mean). Metrics: `tokens`, `pg_loss_sum`, `clip_frac_sum` (tokens whose
    gradient the ratio clip removed), `dual_clip_frac_sum`, `ratio_sum`, `ratio_max`,
    `ratio_min`, `approx_kl_sum` (k3 estimate of KL(old || new)).
    """
    m = mask.to(torch.bool)
    mf = m.to(torch.float32)
    adv = torch.broadcast_to(advantages.to(torch.float32), logprobs.shape)
    # Zero the log-ratio where masked so no inf/nan there can leak into the gradient.
    log_ratio = torch.where(m, logprobs.float() - old_logprobs.detach().float(), 0.0)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -adv * dual_clip
    per_token = torch.where(adv < 0, torch.minimum(clipped, pg3), clipped)
    if coef is not None:
        per_token = per_token * coef.detach().float()
    per_token = torch.where(m, per_token, 0.0)
    loss = per_token.sum() / _normalizer(mf, normalizer)

    with torch.no_grad():
        r = ratio.detach()
        inf = torch.tensor(math.inf, device=r.device)
        metrics: Metrics = {
            "tokens": mf.sum(),
            "pg_loss_sum": per_token.detach().sum(),
            "clip_frac_sum": ((pg2 > pg1) & m).float().sum(),
            "dual_clip_frac_sum": ((adv < 0) & (pg3 < clipped) & m).float().sum(),
            "ratio_sum": (r * mf).sum(),
            "ratio_max": torch.where(m, r, -inf).max(),
            "ratio_min": torch.where(m, r, inf).min(),
            "approx_kl_sum": (((r - 1.0) - log_ratio.detach()) * mf).sum(),
        }
    return loss, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
               estimator: str, normalizer: float | torch.Tensor | None = None
               ) -> tuple[torch.Tensor, Metrics]:
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens, token-mean with the same
    `normalizer` rule as `grpo_loss` (the caller weights it by `algorithm.kl_coef`).

    With d = log pi - log pi_ref (clamped to [-20, 20]): `k1` = d, `k2` = d^2 / 2, `k3` =
    exp(-d) - 1 + d. `ref_logprobs` is a constant. Metrics: `kl_ref_sum`, the k3 estimate
    whichever estimator trains (non-negative, comparable across runs).
    """
    m = mask.to(torch.bool)
    mf = m.to(torch.float32)
    d = torch.where(m, logprobs.float() - ref_logprobs.detach().float(), 0.0).clamp(-20.0, 20.0)
    if estimator == "k1":
        per_token = d
    elif estimator == "k2":
        per_token = 0.5 * d * d
    elif estimator == "k3":
        per_token = torch.exp(-d) - 1.0 + d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")
    per_token = torch.where(m, per_token, 0.0)
    loss = per_token.sum() / _normalizer(mf, normalizer)
    with torch.no_grad():
        k3 = torch.where(m, torch.exp(-d) - 1.0 + d, 0.0).sum()
    return loss, {"kl_ref_sum": k3}


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor,
             normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Masked negative log-likelihood, token-mean with the same `normalizer` rule as
    `grpo_loss`. Metrics: `tokens`, `nll_sum`."""
    m = mask.to(torch.bool)
    nll = torch.where(m, -logprobs.float(), 0.0)
    loss = nll.sum() / _normalizer(m.float(), normalizer)
    return loss, {"tokens": m.float().sum(), "nll_sum": nll.detach().sum()}


@torch.no_grad()
def mismatch_metrics(trainer_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> Metrics:
    """How far the trainer's logprobs are from the engine's sampling logprobs on the same
    tokens: `mismatch_abs_sum` (|diff|) and `mismatch_kl_sum` (k3 estimate of
    KL(sampler || trainer), the tokens being samples of the engine)."""
    m = mask.to(torch.bool)
    d = torch.where(m, trainer_logprobs.float() - sampling_logprobs.float(), 0.0).clamp(-20, 20)
    mf = m.float()
    return {"mismatch_abs_sum": (d.abs() * mf).sum(),
            "mismatch_kl_sum": ((d.exp() - 1.0 - d) * mf).sum()}


class StepStats:
    """Accumulates metric dicts over micro-batches; `reduce` adds up data-parallel ranks.

    Keys ending in `_max` / `_min` keep the extreme, every other key is summed. Every rank must
    have added the same keys before `reduce` (collectives are matched by key order).
    """

    def __init__(self) -> None:
        self._vals: dict[str, torch.Tensor] = {}

    def add(self, metrics: Metrics) -> None:
        for k, v in metrics.items():
            v = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            old = self._vals.get(k)
            if old is None:
                self._vals[k] = v.clone()
            elif k.endswith("_max"):
                self._vals[k] = torch.maximum(old, v.to(old.device))
            elif k.endswith("_min"):
                self._vals[k] = torch.minimum(old, v.to(old.device))
            else:
                self._vals[k] = old + v.to(old.device)

    def reduce(self, device: torch.device | str = "cpu") -> None:
        """All-reduce across the default process group (no-op without one)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        ops = {"sum": dist.ReduceOp.SUM, "_max": dist.ReduceOp.MAX, "_min": dist.ReduceOp.MIN}
        for kind, op in ops.items():
            keys = sorted(k for k in self._vals if _kind(k) == kind)
            if not keys:
                continue
            t = torch.stack([self._vals[k].to(device) for k in keys])
            dist.all_reduce(t, op=op)
            for k, v in zip(keys, t, strict=True):
                self._vals[k] = v

    def raw(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._vals.items()}

    def means(self, prefix: str = "") -> dict[str, float]:
        """`x_sum / tokens` as `x`, extremes as they are (when finite), `tokens` itself."""
        vals = self.raw()
        tokens = vals.get("tokens", 0.0)
        out: dict[str, float] = {}
        for k, v in vals.items():
            if k.endswith("_sum"):
                if tokens > 0:
                    out[prefix + k[: -len("_sum")]] = v / tokens
            elif k.endswith(("_max", "_min")):
                if math.isfinite(v):
                    out[prefix + k] = v
            else:
                out[prefix + k] = v
        return out


def _kind(key: str) -> str:
    for suffix in ("_max", "_min"):
        if key.endswith(suffix):
            return suffix
    return "sum"
