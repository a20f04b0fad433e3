"""The learning-rate schedule: linear warmup, then constant or cosine decay.

Owns: the multiplier applied to the base learning rate at an optimizer step, and a stage's base
rate (`stage_lr`: its `lr` or `algorithm.lr`, with its linear decay), which the train loop and
an SFT stage set through `Trainer.set_lr`. Does not own the optimizer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import StageSection


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int | None) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based, the step about to run).

    Warmup: `(step + 1) / warmup_steps` for the first `warmup_steps` steps, so the first step
    already moves. `"constant"`: 1 afterwards. `"cosine"`: from 1 down to 0 at `total_steps`
    (half a cosine over the steps after warmup), 0 beyond; needs `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        if not total_steps:
            raise ValueError("a cosine schedule needs the total number of optimizer steps")
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def stage_lr(stage: StageSection, base_lr: float, step: int = 0) -> float:
    """The stage's learning rate before its step `step` (0-based): its `lr` (else `base_lr`),
    scaled linearly down over the last `lr_decay_steps` steps (step k of n gets (n - k) / n of
    it, so the last step still moves)."""
    lr = stage.lr or base_lr
    n = stage.lr_decay_steps
    left = stage.steps - step
    return lr * left / n if n and left < n else lr
