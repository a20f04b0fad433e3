"""Group-relative advantages (GRPO), computed on the rollouts RoC kept.

Owns: the advantage formula. Does not own: which rollouts are kept (`roc`) or how advantages
become per-token weights (`batching`, every model token of a rollout gets its rollout's value).

`A_i = (r_i - mean(r)) / (std(r) + eps)` over the kept rewards of one group, with the unbiased
(n - 1) standard deviation, as `torch.std` computes it in the verl GRPO code the released
rStar2-Agent trainer builds on. A group of one, or of equal rewards, gets all zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """Normalised advantages of one group's kept rewards (parallel to `rewards`)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]
