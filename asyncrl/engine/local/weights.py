"""The local engine's base-weight loads: an update's tensors (or an HF safetensors directory)
into the engine's model in place.

Owns: reading an update's tensors, mapping an MoE checkpoint's per-expert names onto the
model's fused ones, refusing an update that is not the whole model in its shapes before
anything is loaded, and skipping tensors that already are the model's own (`weight_sync =
"shared"`: the trainer's live parameters). Does not own: when updates land (the engine, between
steps), adapters (`lora_merge`), re-packing (`packed`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.engine.base import WeightUpdate
from asyncrl.errors import WeightSyncError
from asyncrl.modeling import fuse_experts


def load_base(model: Any, update: WeightUpdate, name: str) -> None:
    """Load `update`'s base weights (`state_dict`, else the safetensors in `path`) into
    `model` in place; `name` (the engine's) labels errors. Raises `WeightSyncError` before
    loading anything when the update is not the whole model in its shapes."""
    sd: Any = update.state_dict
    if sd is None:
        if not update.path:
            raise WeightSyncError(f"{name}: weight update has neither tensors nor a path")
        from safetensors.torch import load_file

        files = sorted(Path(update.path).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"{name}: no *.safetensors in {update.path}")
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
    assert isinstance(sd, dict)
    own = model.state_dict()
    sd = fuse_experts(sd, own)  # an MoE checkpoint's per-expert names
    check_update(model, sd, name)
    # Tensors that are the model's own (`weight_sync = "shared"`: the trainer's live
    # parameters) already hold the update; only the packed copies must follow (the caller).
    sd = {k: t for k, t in sd.items() if not same_tensor(t, own[k])}
    if sd:
        with torch.no_grad():
            # strict=False only for tied aliases and the model's own tensors, which
            # check_update found covered
            model.load_state_dict(sd, strict=False)


def check_update(model: Any, sd: dict[str, Any], name: str) -> None:
    """Refuse, before loading anything, an update that is not the whole model in its
    shapes: unknown or missing names (a tied alias such as `lm_head.weight`, which HF drops
    on save, counts as present when its twin is), or a tensor of another shape."""
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(sd.keys() - own.keys())
    if unexpected:
        raise WeightSyncError(f"{name}: unknown parameters in update: {unexpected[:5]}")
    by_storage: dict[int, set[str]] = {}
    for key, t in own.items():
        by_storage.setdefault(t.data_ptr(), set()).add(key)
    missing = sorted(k for k in own.keys() - sd.keys()
                     if not by_storage[own[k].data_ptr()] & sd.keys())
    if missing:
        raise WeightSyncError(f"{name}: missing parameters in update ({len(missing)}): "
                              f"{missing[:5]}")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise WeightSyncError(f"{name}: shape of {k} is {tuple(t.shape)} in the "
                                  f"update, {tuple(own[k].shape)} in the model")


def same_tensor(a: Any, b: Any) -> bool:
    """`a` and `b` are views of the same memory in the same layout."""
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())
