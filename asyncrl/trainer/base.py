"""The trainer protocol: what the train loop may ask of any trainer (torch, megatron).

Owns: the `Trainer` interface and its contract. Does not own: any implementation
(`torch_trainer.py`, `megatron/`), the algorithm (`asyncrl.algo`), or the loop.

Contract:
- `train_step(batch, lr_scale)`: one RL step, blocking. The kept rollouts of `batch` (with the
  advantages `apply_roc` wrote) are split into `algorithm.optimizer_steps_per_rl_step`
  mini-batches; the trainer first recomputes the old logprobs of every sequence with the
  current weights (the engine's sampling logprobs are kept only for the mismatch metric), then
  takes one optimizer step per mini-batch with `asyncrl.algo.loss.grpo_loss`. Returns flat
  float metrics named `train/…`.
- `sft_step(examples)`: one optimizer step of masked cross-entropy on (token ids, loss mask)
  pairs (the SFT cold start). Returns `sft/…` metrics. `sft_eval(examples)`: the same loss
  without an update (held-out loss; `sft/loss` is the token mean).
- `give_up` (both steps): asked before each micro-batch until the step's first optimizer
  step; true, and the trainer drops the gradients and raises `StepAbandoned`, its weights and
  optimizer those of the last completed step (the loop's stop, `StopRequest.overdue`, when a
  step would outlast the grace period). A trainer may not ask it (multi-rank ones do not:
  every rank must take the same micro-batches); the stop then waits for the step's end.
- `state_dict_for_sync()`: full (unsharded) weights by HF parameter name, for an in-process
  engine; `export_hf(path)` writes an HF model directory (weights and config, not the
  tokenizer) for engines that load from disk and for users.
- `save_state(path)` / `load_state(path)`: model, optimizer and lr-schedule state; `path` is a
  directory the trainer owns. Restoring and training on gives the same parameters as never
  having stopped.
- `set_lr(lr)`: the base learning rate from now on (a stage's override); warmup and schedule
  multiply it.
- A trainer that trains LoRA adapters also implements `AdapterTrainer` (below): once
  `lora_active`, weight sync sends the adapter, plus the base weights whenever
  `base_changed` (cleared by `weights_pushed`, which records `base_version`).
- Under torchrun every rank calls every method with the same arguments; rank 0 alone writes
  files in `export_hf` (other ranks take part in the gathers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncrl.records import Batch

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Trainer(Protocol):
    model: Any
    """The trained model (an HF `PreTrainedModel` for the torch trainer, unwrapped)."""

    def train_step(self, batch: Batch, lr_scale: float = 1.0,
                   give_up: Callable[[], bool] | None = None) -> dict[str, float]: ...

    def sft_step(self, examples: list[tuple[list[int], list[int]]],
                 give_up: Callable[[], bool] | None = None) -> dict[str, float]: ...

    def sft_eval(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]: ...

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]: ...

    def export_hf(self, path: str | Path) -> None: ...

    def save_state(self, path: str | Path) -> None: ...

    def load_state(self, path: str | Path) -> None: ...

    def set_lr(self, lr: float) -> None: ...


@runtime_checkable
class AdapterTrainer(Protocol):
    """A trainer that may train LoRA adapters over a frozen base (the torch trainer)."""

    lora_active: bool
    """The adapter is attached: syncs carry it instead of full weights."""
    base_changed: bool
    """The base weights differ from those the engines were last sent (`weights_pushed` clears
    it)."""
    base_version: int
    """Policy version of the last push that carried the base (adapter updates name it)."""

    def adapter_for_sync(self) -> dict[str, torch.Tensor]:
        """`{module}.lora_A` [r, in] and `{module}.lora_B` [out, r] (scaling folded in) by HF
        module name: the engine computes `W_base + B @ A`."""
        ...

    def base_state_for_sync(self) -> dict[str, torch.Tensor]: ...

    def export_adapter(self, path: str | Path) -> None:
        """The adapter as a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`)."""
        ...

    def export_base(self, path: str | Path) -> None:
        """The base weights as an HF model directory."""
        ...

    def weights_pushed(self, version: int, *, with_base: bool, missed: int) -> None:
        """The push of `version` is done: it carried the base weights (`with_base`) or only
        the adapter, and `missed` engines did not take it. An engine that missed a base must
        get it again with the next adapter."""
        ...
