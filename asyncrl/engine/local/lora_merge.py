"""Serving a LoRA adapter from an in-process model by merging it into the weights.

Owns: `AdapterMerger`, which keeps a copy of the base weight of every adapted linear layer and
writes `W = W_base + B @ A` into the live parameter in place (so the engine's forward, KV
cache and batching are untouched), and `read_adapter_dir`, a PEFT adapter directory as the
factors `WeightUpdate.adapter` carries. Does not own: when an update applies (the engine's
step lock), versions, or producing adapters (`asyncrl.trainer.lora`).

The base copy is what makes repeated adapters exact: each update is merged onto the base, never
onto the previous merge (subtracting the old product would drift in bf16). It costs one copy of
the adapted layers' weights, taken the first time a layer is adapted after a base update.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.errors import WeightSyncError


class AdapterMerger:
    """Merges adapters into `model`'s linear weights (`model`: an HF `nn.Module`)."""

    def __init__(self, model: Any, name: str) -> None:
        self._model = model
        self._name = name
        self._base: dict[str, Any] = {}
        self.base_version: int | None = 0
        """The update version of the base weights held (0: the weights the engine was built
        with); None when unknown (a failed load)."""

    def new_base(self, version: int | None) -> None:
        """The model's weights were replaced: forget the copies, record the base's version."""
        self._base.clear()
        self.base_version = version

    def check(self, factors: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """(A, B) by parameter name (`{module}.weight`); refuses unknown modules, unpaired
        factors and shapes that do not fit, before anything is changed."""
        params = dict(self._model.named_parameters())
        pairs: dict[str, tuple[Any, Any]] = {}
        for key in factors:
            module, _, part = key.rpartition(".")
            if part not in ("lora_A", "lora_B") or not module:
                raise WeightSyncError(f"{self._name}: adapter key {key!r} is not "
                                      f"`<module>.lora_A` / `<module>.lora_B`")
            a, b = factors.get(f"{module}.lora_A"), factors.get(f"{module}.lora_B")
            w = params.get(f"{module}.weight")
            if w is None:
                raise WeightSyncError(f"{self._name}: adapter names unknown module {module!r}")
            if a is None or b is None:
                raise WeightSyncError(f"{self._name}: adapter of {module!r} lacks lora_A or "
                                      f"lora_B")
            if (a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]
                    or (b.shape[0], a.shape[1]) != tuple(w.shape)):
                raise WeightSyncError(f"{self._name}: adapter of {module!r} is B{tuple(b.shape)}"
                                      f" @ A{tuple(a.shape)}, the weight is {tuple(w.shape)}")
            pairs[f"{module}.weight"] = (a, b)
        return pairs

    def apply(self, factors: dict[str, Any], base_version: int) -> None:
        """Serve `W_base + B @ A` for each adapted layer; layers adapted before but absent now
        go back to their base. Raises `WeightSyncError` (nothing changed) when the engine does
        not hold the adapter's base."""
        import torch

        if self.base_version != base_version:
            raise WeightSyncError(f"{self._name}: adapter trained over the base of version "
                                  f"{base_version}, the engine holds version "
                                  f"{self.base_version}'s; send the base with it")
        pairs = self.check(factors)
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for key in sorted(self._base.keys() - pairs.keys()):
                params[key].copy_(self._base.pop(key))
            for key, (a, b) in pairs.items():
                w = params[key]
                base = self._base.get(key)
                if base is None:
                    base = self._base[key] = w.detach().clone()
                delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
                w.copy_((base.float() + delta).to(w.dtype))


def read_adapter_dir(path: str | Path) -> dict[str, Any]:
    """A PEFT adapter directory as `WeightUpdate.adapter` factors (HF module names, the
    `alpha / r` scaling, or `alpha / sqrt(r)` with rsLoRA, folded into B). Raises
    `WeightSyncError` for a directory that is not one."""
    from safetensors.torch import load_file

    d = Path(path)
    try:
        conf = json.loads((d / "adapter_config.json").read_text())
        raw = load_file(str(d / "adapter_model.safetensors"))
        r = int(conf["r"])
    except (OSError, ValueError, KeyError) as e:
        raise WeightSyncError(f"not a PEFT adapter directory: {d}: {e}") from e
    alpha = float(conf.get("lora_alpha") or r)
    scale = alpha / (r ** 0.5) if conf.get("use_rslora") else alpha / r
    out: dict[str, Any] = {}
    for key, t in raw.items():
        name = key.removeprefix("base_model.model.")  # PEFT's prefix of the HF module names
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                out[f"{name[: -len(suffix)]}.{part}"] = t.float() * scale if part == "lora_B" else t
    if not out:
        raise WeightSyncError(f"{d}: no lora_A / lora_B tensors in adapter_model.safetensors")
    return out
