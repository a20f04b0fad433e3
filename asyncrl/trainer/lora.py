"""LoRA adapters on an HF model, through PEFT: attaching them, and the adapter's three shapes
the rest of asyncrl needs (in-memory factors for an in-process engine, a PEFT adapter
directory for servers and `final/`, merged full weights by HF name).

Owns: the PEFT calls (imported lazily: `import asyncrl.config` and the trainer registry load
no peft), the mapping between PEFT's module names and the HF model's, and the merge rule
`W = W_base + (alpha / r) * B @ A`. Does not own: the optimizer, the steps, when the adapter
is attached (`torch_trainer.TorchTrainer`), or how an engine applies an adapter
(`asyncrl.engine.local.engine`, `sglang_weights`).

The in-memory adapter (`adapter_tensors`) is keyed by the HF module name of each adapted
linear layer: `{module}.lora_A` [r, in] and `{module}.lora_B` [out, r] with the scaling
already folded into B, so that the receiver computes `W_base + B @ A` knowing nothing of
alpha or rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import LoraSection
from asyncrl.errors import TrainerError

ADAPTER = "default"
"""PEFT's name of the one adapter asyncrl trains."""


def attach(model: Any, cfg: LoraSection, seed: int = 0) -> Any:
    """Wrap `model` (an HF `PreTrainedModel`, changed in place: its targeted linear layers
    become LoRA layers) into a `peft.PeftModel` whose only trainable parameters are the
    adapters. B starts at zero, so the wrapped model computes what `model` did.

    A is drawn (PEFT's Kaiming init, on the CPU before the layers move to the base's device)
    from a generator seeded by `seed` alone, the process's torch RNG forked around it: the
    adapter, hence every update after, is the same in every run of a curriculum. Otherwise a
    run from a pretrained base (nothing seeds torch before it) would start each process from
    another A, and a stopped run could not be compared with an unstopped one."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise TrainerError("trainer.lora needs PEFT: pip install 'asyncrl[lora]'") from e
    lcfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, lcfg, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT's error when no module matches, or a non-linear target
        raise TrainerError(f"trainer.lora.target_modules: {e}") from e


def hf_model(peft_model: Any) -> Any:
    """The HF model inside a `PeftModel` (its adapted layers are LoRA layers)."""
    return peft_model.base_model.model


def lora_layers(peft_model: Any) -> Iterator[tuple[str, Any]]:
    """(HF module name, PEFT LoRA layer) of every adapted linear layer."""
    from peft.tuners.lora import LoraLayer

    for name, m in hf_model(peft_model).named_modules():
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
            yield name, m


def adapter_tensors(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter as `{module}.lora_A` and scaled `{module}.lora_B` CPU copies (see the
    module docstring); the whole payload of an in-process adapter sync."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, m in lora_layers(peft_model):
            out[f"{name}.lora_A"] = m.lora_A[ADAPTER].weight.detach().to("cpu", copy=True)
            out[f"{name}.lora_B"] = (m.lora_B[ADAPTER].weight.detach().float()
                                     * m.scaling[ADAPTER]).to("cpu")
    return out


def merged_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """Full weights by the HF model's own parameter names, adapters merged in (new tensors;
    the live model is untouched)."""
    deltas = {f"{name}.weight": m.get_delta_weight(ADAPTER) for name, m in lora_layers(peft_model)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in hf_model(peft_model).state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            t = t.detach()
            out[key] = (t + deltas[key].to(t.dtype)) if key in deltas else t
    return out


def base_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights by HF name (views, adapters left out)."""
    return {k.replace(".base_layer.", "."): v.detach()
            for k, v in hf_model(peft_model).state_dict().items() if ".lora_" not in k}


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The trainable adapter parameters by their names in `peft_model` (for checkpoints)."""
    return {k: v.detach() for k, v in peft_model.named_parameters() if v.requires_grad}


def load_adapter_state(peft_model: Any, state: dict[str, torch.Tensor]) -> None:
    """Restore `adapter_state`'s output; refuses a state of other names or shapes."""
    own = dict(peft_model.named_parameters())
    want = {k for k, v in own.items() if v.requires_grad}
    if set(state) != want:
        diff = sorted(set(state) ^ want)
        raise TrainerError(f"adapter checkpoint does not match trainer.lora: {diff[:4]} "
                           f"(rank or target_modules changed?)")
    with torch.no_grad():
        for k, v in state.items():
            if own[k].shape != v.shape:
                raise TrainerError(f"adapter checkpoint: shape of {k} is {tuple(v.shape)}, "
                                   f"the trainer's is {tuple(own[k].shape)} (rank changed?)")
            own[k].copy_(v)


def save_adapter(peft_model: Any, path: str | Path) -> None:
    """A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`), what
    `PeftModel.from_pretrained`, SGLang's and vLLM's LoRA loaders read. Written directly
    rather than by `save_pretrained`, which also renders a model card (most of its time)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_model.peft_config[ADAPTER].save_pretrained(str(out))
