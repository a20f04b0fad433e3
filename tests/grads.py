"""Recording the gradients each optimizer step applies, and comparing two runs' records.

Not a test module: imported by the trainer tests (`tests/trainer`, `tests/megatron`) the way
`micro_config` is. Gradients, not weights, are compared tightly: Adam's first steps move a
weight by about lr * sign(grad), so weights whose gradient is float noise differ by up to ~lr
between two equivalent runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Grads = dict[str, torch.Tensor]


def on_optimizer_step(optimizer: Any, snapshot: Callable[[], Grads]) -> list[Grads]:
    """Wrap `optimizer.step` so that each call first appends `snapshot()` (the gradients as
    the step sees them: after clipping) to the returned list."""
    steps: list[Grads] = []
    step = optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        steps.append(snapshot())
        return step(*args, **kwargs)

    optimizer.step = recording
    return steps


def record_grads(tr: Any) -> list[Grads]:
    """The gradients each optimizer step of torch trainer `tr` applies, by parameter name
    (copies; parameters without a gradient, such as a frozen LoRA base, are left out). Call it
    after anything that replaces `tr.optimizer` (attaching a LoRA adapter does)."""
    return on_optimizer_step(tr.optimizer, lambda: {
        n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})


def assert_grads_close(mine: list[Grads], ref: list[Grads], *, atol: float = 1e-7,
                       rtol: float = 1e-4) -> None:
    """The same number of steps (at least one), and each gradient of `mine` close to the one
    of the same name in `ref`."""
    assert len(mine) == len(ref) > 0
    for a, b in zip(mine, ref, strict=True):
        for k, g in a.items():
            torch.testing.assert_close(g, b[k], atol=atol, rtol=rtol, msg=k)
