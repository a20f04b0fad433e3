"""oneDNN linear layers with pre-packed weights, for the local engine on a CPU.

Owns: pointing the forward of every fp32 `nn.Linear` of the engine's model at oneDNN's linear
over a copy of its weight laid out once for the kernel (`torch.ops.mkldnn._reorder_linear_weight`,
the ops PyTorch's own inductor uses when it freezes a CPU model), and laying the copies out
again after the weights change (`repack`, which the engine calls after every weight update and
adapter merge). Does not own: when the weights change (the engine), the model.

Why: a decode step multiplies a few rows (one per running request) by every weight. PyTorch's
default fp32 product reads each weight in its plain layout on every call; oneDNN's packed layout
streams it in the blocks its kernel wants. The figures (SmolLM2-135M's decode, against vLLM's
CPU build) are in docs/real-models.md; `bench/smollm2_engines.py` measures them.

Costs: a second copy of every linear weight (the plain one stays: updates, adapters and the
state dict read it), and a re-pack after each update (SmolLM2-135M's whole weight sync,
re-pack included, took 0.2-0.4 s per RL step). Numerics: another summation order than
PyTorch's default product (in that run the engine's log-probs and the trainer's differed by
8e-7 per token). Where the ops are missing, or a probe product disagrees with
`F.linear`, nothing is changed and `pack_linears` returns None.
"""

from __future__ import annotations

from typing import Any

from asyncrl.log import get_logger

log = get_logger(__name__)


class PackedLinears:
    """The packed linear layers of one model; `repack()` after the weights change, `unpack()`
    to give the layers their own forward back."""

    def __init__(self, torch: Any, layers: list[Any]) -> None:
        self._torch = torch
        self.layers = layers
        self.repack()
        for m in layers:
            m.forward = _packed_forward(torch, m)

    def repack(self) -> None:
        with self._torch.no_grad():
            for m in self.layers:
                m._asyncrl_packed = self._torch.ops.mkldnn._reorder_linear_weight(
                    m.weight.detach(), None)

    def unpack(self) -> None:
        for m in self.layers:
            del m.forward
            del m._asyncrl_packed


def _packed_forward(torch: Any, m: Any) -> Any:
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: Any) -> Any:
        return linear(x, m._asyncrl_packed, m.bias, "none", [], "")

    return forward


def pack_linears(model: Any, device: Any) -> PackedLinears | None:
    """Pack every fp32 `nn.Linear` of `model` on a CPU `device`; None (and nothing changed)
    elsewhere, without oneDNN, or where a probe product disagrees with `F.linear`."""
    import torch

    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
              and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if not layers:
        return None
    try:
        probe = layers[0]
        x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            w = torch.ops.mkldnn._reorder_linear_weight(probe.weight.detach(), None)
            got = torch.ops.mkldnn._linear_pointwise(x, w, probe.bias, "none", [], "")
            want = torch.nn.functional.linear(x, probe.weight, probe.bias)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"probe product off by {float((got - want).abs().max()):.3g}")
    except (AttributeError, RuntimeError) as e:
        log.warning("packed_linears_unavailable", error=str(e)[:200])
        return None
    return PackedLinears(torch, layers)
