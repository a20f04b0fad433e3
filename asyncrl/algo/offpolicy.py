"""Off-policy corrections between the policy that sampled a token and the one being trained.

Owns: the per-token correction coefficient of each `algorithm.correction` kind
(`correction_coef`), the mismatch metrics of a batch (`mismatch_stats`, `RatioQuantiles`). Pure
torch functions on `[B, T]` tensors, no model and no optimizer. Does not own: the clipped PPO
term (`loss.grpo_loss`) or where the log-probs come from (trainers).

Three policies (the decoupled PPO of Hilton et al. 2022, as AReaL uses it):
- behaviour  mu: the engine's sampling log-probs, recorded with each token; under staleness
  > 0 a token may come from an older version than the trainer's, and even at staleness 0 the
  engine's kernels differ from the trainer's;
- proximal pi_prox: the trainer's recomputation before the update (today's "old");
- current pi_theta: the trainer's log-probs with gradient.

The clipped ratio is always pi_theta / pi_prox (trust region around the weights being
updated). The behaviour weight w = pi_prox / mu (detached) multiplies the per-token loss:

| kind        | coefficient on the clipped per-token loss                          |
| ----------- | ------------------------------------------------------------------ |
| `none`      | 1 (the loss ignores mu: today's objective, biased when mu != pi)   |
| `tis`       | min(w, tis_cap) (token-level truncated importance sampling)        |
| `icepop`    | 1 if icepop_low <= w <= icepop_high else 0 (IcePop token masking)  |
| `decoupled` | w, and 0 where decoupled_cap > 0 and w > decoupled_cap              |

A coefficient of 0 removes the token's gradient but the token still counts in the token-mean
normaliser (the batch's trained tokens), so masking does not re-weight the other tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmSection

Metrics = dict[str, torch.Tensor]
Correction = Literal["none", "tis", "icepop", "decoupled"]
CORRECTIONS: tuple[Correction, ...] = ("none", "tis", "icepop", "decoupled")

_LOG_CLAMP = 20.0


def behaviour_log_ratio(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor
                        ) -> torch.Tensor:
    """log(pi_prox / mu) per token, 0 where `mask` is 0, clamped to +-20 (detached)."""
    m = mask.to(torch.bool)
    d = proximal.detach().float() - behaviour.detach().float()
    return torch.where(m, d, 0.0).clamp(-_LOG_CLAMP, _LOG_CLAMP)


def correction_coef(kind: str, proximal: torch.Tensor, behaviour: torch.Tensor,
                    mask: torch.Tensor, *, tis_cap: float = 2.0, icepop_low: float = 0.5,
                    icepop_high: float = 2.0, decoupled_cap: float = 0.0
                    ) -> tuple[torch.Tensor, Metrics]:
    """The per-token coefficient of `kind` (see the module table; 0 where `mask` is 0) and its
    metric sums: `corr_coef_sum` (the coefficients), `corr_masked_frac_sum` (trained tokens whose
    coefficient the rule set to 0), `corr_truncated_frac_sum` (tokens whose weight was capped)."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {kind!r}; known: {CORRECTIONS}")
    m = mask.to(torch.bool)
    mf = m.float()
    w = torch.exp(behaviour_log_ratio(proximal, behaviour, mask))
    zero = torch.zeros_like(w)
    truncated = zero
    if kind == "none":
        coef = torch.ones_like(w)
    elif kind == "tis":
        coef = w.clamp(max=tis_cap)
        truncated = (w > tis_cap).float()
    elif kind == "icepop":
        coef = ((w >= icepop_low) & (w <= icepop_high)).float()
    else:  # decoupled
        coef = w if decoupled_cap <= 0 else torch.where(w > decoupled_cap, 0.0, w)
    coef = torch.where(m, coef, 0.0)
    masked = ((coef == 0) & m).float()
    return coef, {"corr_coef_sum": coef.sum(), "corr_masked_frac_sum": masked.sum(),
                  "corr_truncated_frac_sum": (truncated * mf).sum()}


@torch.no_grad()
def mismatch_stats(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                   lag: torch.Tensor | None = None) -> Metrics:
    """How far the sampler was from the trainer on the trained tokens, split by staleness.

    `lag` (`[B, T]` ints, trainer version minus sampling version; None = all 0). Sums over
    trained tokens (divide by `tokens` for means; `StepStats` does): `mismatch_kl_sum` (k3
    estimate of KL(mu || pi_prox): with d = log pi_prox - log mu on tokens drawn from mu,
    exp(d) - 1 - d, unbiased and >= 0), `mismatch_abs_sum` (|d|), `stale_token_frac_sum`
    (lag > 0), `stale_kl_sum` (k3 on stale tokens only); extremes `version_lag_max`,
    `mismatch_ratio_max`, `mismatch_ratio_min` (w = exp(d))."""
    m = mask.to(torch.bool)
    mf = m.float()
    d = behaviour_log_ratio(proximal, behaviour, mask)
    k3 = (d.exp() - 1.0 - d) * mf
    lag_t = torch.zeros_like(d) if lag is None else lag.float()
    stale = (lag_t > 0) & m
    w = d.exp()
    inf = torch.tensor(math.inf, device=d.device)
    return {
        "mismatch_kl_sum": k3.sum(),
        "mismatch_abs_sum": (d.abs() * mf).sum(),
        "stale_token_frac_sum": stale.float().sum(),
        "stale_kl_sum": torch.where(stale, k3, 0.0).sum(),
        "version_lag_max": torch.where(m, lag_t, 0.0).max(),
        "mismatch_ratio_max": torch.where(m, w, -inf).max(),
        "mismatch_ratio_min": torch.where(m, w, inf).min(),
    }


def correction_for(algo: AlgorithmSection, proximal: torch.Tensor, behaviour: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """`correction_coef` with the kind and bounds of the run's `[algorithm]` section."""
    return correction_coef(algo.correction, proximal, behaviour, mask, tis_cap=algo.tis_cap,
                           icepop_low=algo.icepop_low, icepop_high=algo.icepop_high,
                           decoupled_cap=algo.decoupled_cap)


class RatioQuantiles:
    """Collects the behaviour log-ratios of trained tokens over a step and reports quantiles
    of the ratio w = pi_prox / mu over the whole step: under data parallelism `metrics` gathers
    every replica's tokens first (one float each; a step's tokens fit in memory)."""

    QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        d = behaviour_log_ratio(proximal, behaviour, mask)
        self._parts.append(d[mask.to(torch.bool)].detach().float().cpu())

    def metrics(self, prefix: str = "",
                gather: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> dict[str, float]:
        """`{prefix}mismatch_ratio_p01 .. _p99`; empty when no token was added on any rank.
        `gather` (`StepBackend.gather_replicas`) concatenates every data-parallel replica's
        log-ratios; every rank must call it, with tokens or without."""
        d = torch.cat(self._parts) if self._parts else torch.zeros(0)
        if gather is not None:
            d = gather(d).cpu()
        if d.numel() == 0:
            return {}
        q = quantiles(d, self.QUANTILES).exp()
        return {f"{prefix}mismatch_ratio_p{round(p * 100):02d}": float(v)
                for p, v in zip(self.QUANTILES, q, strict=True)}


def gather_1d(x: torch.Tensor, device: torch.device | str = "cpu",
              group: Any = None) -> torch.Tensor:
    """Every rank's 1-D `x` (lengths may differ) concatenated in rank order, over `group`
    (the default process group when None); `x` itself without a process group. Collective:
    every rank of the group calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    world = dist.get_world_size(group)
    x = x.to(device=device, dtype=torch.float32).flatten()
    n = torch.tensor([x.numel()], device=device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    lengths = [int(s) for s in sizes]
    longest = max(lengths)
    if longest == 0:
        return x[:0]
    padded = torch.zeros(longest, device=device, dtype=torch.float32)
    padded[:x.numel()] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:k] for p, k in zip(parts, lengths, strict=True)])


def quantiles(x: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """`torch.quantile(x, qs)` (linear interpolation) for a 1-D tensor of any length.

    torch.quantile refuses inputs over 2^24 elements, and a step of a large run holds more
    trained tokens than that on one rank: one sort, then the same interpolation."""
    s = torch.sort(x.flatten().to(torch.float64)).values
    pos = torch.tensor(qs, dtype=torch.float64) * (s.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    return (s[lo] + (s[hi] - s[lo]) * (pos - lo)).to(x.dtype)
