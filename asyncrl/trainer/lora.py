"""LoRA adapters on an HF model, through PEFT: attaching them, and the adapter's three shapes
the rest of asyncrl needs (in-memory factors for an in-process engine, a PEFT adapter
directory for servers and `final/`, merged full weights by HF name).

Owns: the PEFT calls (imported lazily: `import asyncrl.config` and the trainer registry load
no peft), the mapping between PEFT's module names and the HF model's, the merge rule
`W = W_base + (alpha / r) * B @ A`, and the torch trainer's LoRA face (`LoraFace`: attaching
the adapter, its syncs, exports and checkpoint state). Does not own: the optimizer, the steps,
when the adapter is attached (`torch_trainer.TorchTrainer`), or how an engine applies an
adapter (`asyncrl.engine.local.engine`, `sglang_weights`).

The in-memory adapter (`adapter_tensors`) is keyed by the HF module name of each adapted
linear layer: `{module}.lora_A` [r, in] and `{module}.lora_B` [out, r] with the scaling
already folded into B, so that the receiver computes `W_base + B @ A` knowing nothing of
alpha or rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config import LoraSection
from asyncrl.errors import TrainerError
from asyncrl.log import get_logger

log = get_logger(__name__)

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


class LoraFace:
    """The LoRA face of `torch_trainer.TorchTrainer`: attaching the adapter, the
    `base.AdapterTrainer` methods weight sync calls, and the adapter's exports and checkpoint
    state. A mixin: the trainer sets up its state (`_init_lora`) and lends it the model, the
    optimizer and the schedule state named below; nothing here runs a step.
    """

    model: Any
    optimizer: torch.optim.Optimizer
    seed: int
    reference: Any
    _opt_step: int
    _base_lr: float

    if TYPE_CHECKING:
        def _new_optimizer(self) -> torch.optim.Optimizer: ...
        def state_dict_for_sync(self) -> dict[str, torch.Tensor]: ...

    def _init_lora(self, cfg: LoraSection | None) -> None:
        self.lora_cfg = cfg
        self.peft: Any = None
        """The `peft.PeftModel` around `model` once the adapter is attached."""
        self.base_changed = True
        """The base weights differ from those last sent to the engines (`AdapterTrainer`)."""
        self.base_version = 0
        """Policy version of the last push that carried the base weights."""
        self._base_trained = False

    @property
    def lora_active(self) -> bool:
        """True once the adapter is attached: syncs and checkpoints carry the adapter."""
        return self.peft is not None

    def attach_lora(self) -> None:
        """Freeze the base, add the adapters, and restart the optimizer on them alone (the
        schedule's step count goes on). Idempotent."""
        if self.peft is not None or self.lora_cfg is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.peft = attach(self.model, self.lora_cfg, self.seed)
        self.model.train()
        self.optimizer = self._new_optimizer()
        self.base_changed = True
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        base = sum(p.numel() for n, p in self.model.named_parameters() if ".lora_" not in n)
        log.info("lora_attached", rank=self.lora_cfg.rank, adapter_params=trainable,
                 base_params=base, share_of_base=round(trainable / base, 4))

    def adapter_for_sync(self) -> dict[str, torch.Tensor]:
        """The adapter factors by HF module name (`adapter_tensors`), CPU copies."""
        return adapter_tensors(self.peft)

    def base_state_for_sync(self) -> dict[str, torch.Tensor]:
        """The frozen base weights by HF name (views of the live tensors)."""
        return base_state_dict(self.peft)

    def export_adapter(self, path: str | Path) -> None:
        """The adapter as a PEFT directory at `path`."""
        save_adapter(self.peft, path)

    def export_base(self, path: str | Path) -> None:
        """The frozen base weights as an HF model directory at `path`."""
        self._save_hf(path, self.base_state_for_sync())

    def weights_pushed(self, version: int, *, with_base: bool, missed: int) -> None:
        """`AdapterTrainer`: a push carrying the base clears `base_changed` unless an engine
        missed it, and becomes the base that later adapters name."""
        if self.lora_active and with_base:
            self.base_changed = missed > 0
            self.base_version = version

    def _save_hf(self, path: str | Path, sd: dict[str, torch.Tensor]) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        hf_model(self.peft).save_pretrained(out, state_dict=sd, safe_serialization=True)

    def _merged_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights by HF name with the adapter merged in (`merged_state_dict`)."""
        return merged_state_dict(self.peft)

    def _export_lora(self, path: str | Path) -> None:
        """`export_hf` with the adapter attached: the adapter at `path`, `path/base/` the base
        when this run trained it, `path/merged/` the merged model with `merge_on_export`."""
        assert self.lora_cfg is not None
        self.export_adapter(path)
        if self._base_trained:
            self.export_base(Path(path) / "base")
        if self.lora_cfg.merge_on_export:
            self._save_hf(Path(path) / "merged", self.state_dict_for_sync())

    def _lora_state(self) -> dict[str, Any]:
        """The trainer state of a checkpoint with the adapter attached: the adapter, its
        optimizer state and the schedule, plus the base weights only when this run trained
        them (otherwise the base is what the run starts from anyway)."""
        state: dict[str, Any] = {
            "adapter": adapter_state(self.peft),
            "optimizer": self.optimizer.state_dict(),
            "schedule": {"opt_step": self._opt_step, "base_lr": self._base_lr},
            "lora": {"attached": True, "base_trained": self._base_trained}}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        if self._base_trained:
            state["base"] = {k: v for k, v in self.model.state_dict().items()
                             if ".lora_" not in k}
        return state

    def _load_lora_state(self, state: dict[str, Any]) -> None:
        """Restore `_lora_state`'s output: attach the adapter, then the base (if saved), the
        adapter and its optimizer state. The trainer restores the schedule and reference."""
        if self.lora_cfg is None:
            raise TrainerError("the checkpoint holds a LoRA adapter; set trainer.lora to "
                               "resume it")
        self.attach_lora()
        if "base" in state:
            missing, unexpected = self.model.load_state_dict(state["base"], strict=False)
            if unexpected or any(".lora_" not in k for k in missing):
                raise TrainerError(f"checkpoint base weights do not fit the model: "
                                   f"{(unexpected or missing)[:4]}")
        load_adapter_state(self.peft, state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
