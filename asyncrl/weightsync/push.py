"""Pushing one weight version from the trainer into the engines: the train loop's whole push.

Owns: `push_weights`: the trainer's weights as an HF directory, an in-memory state dict, or a
broadcast over the run's `group.WeightGroup`, as `engine.weight_sync` says; to every engine (the
run goes on while one engine took them); older exported versions removed. A trainer training
LoRA is told what was pushed (`AdapterTrainer.weights_pushed`) and keeps its own LoRA state.

Weights flow one way: trainer -> weightsync -> engine. Does not own: the update sequence of
one server (pause, apply, flush, version, resume: `engine.remote.engine.RemoteEngine`), any
server's weight endpoints (`engine.sglang.weights`, `engine.vllm`), fanning one update out to
several engines (`engine.base.push_to_all`), the trainer's state dict, export and LoRA state,
or the distributed mode's process group (`group`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.engine.base import Engine, WeightUpdate, push_to_all
from asyncrl.errors import WeightSyncError
from asyncrl.log import get_logger
from asyncrl.trainer.base import AdapterTrainer

if TYPE_CHECKING:
    from asyncrl.trainer.base import Trainer
    from asyncrl.weightsync.group import WeightGroup

log = get_logger(__name__)


async def push_weights(engines: Sequence[Engine], trainer: Trainer, version: int,
                       mode: str, run_dir: Path, group: WeightGroup | None = None
                       ) -> WeightUpdate:
    """The trainer's current weights to every engine as `version`.

    "disk": the trainer exports an HF directory `run_dir/weights/v{version}` and the engines
    load it from there (older `v*` directories are removed once they have); "tensor": the
    trainer's full state dict, in memory ("shared" sends the same, and a local engine whose
    model holds those very tensors only re-packs); "distributed": the state dict broadcast over
    `group` (`weight_group.WeightGroup`, SGLang servers only; formed on the first push and
    re-formed after a failure). A trainer training LoRA (`AdapterTrainer`) sends
    only its adapter (`v{version}/adapter`, a PEFT directory, on disk), and the base weights
    with it only when they changed since the last push that every engine took. An engine
    whose update fails keeps its old weights (its tokens keep their old version tags) and the
    push goes on; it raises only when no engine took them.
    """
    if mode == "distributed":
        return await _push_distributed(engines, trainer, version, group)
    update = await _payload(trainer, version, mode, Path(run_dir))
    failed = await push_to_all(engines, update)
    for name, err in failed:
        log.error("weight_sync_failed", version=version, engine=name, error=str(err))
    if failed and len(failed) == len(engines):
        raise failed[0][1]
    if isinstance(trainer, AdapterTrainer):
        trainer.weights_pushed(version, with_base=update.has_base, missed=len(failed))
    if update.path or update.adapter_path:
        root = Path(run_dir) / "weights"
        for old in root.glob("v*"):
            if old.name != f"v{version}" and (update.has_base or not _holds_base_of(old, update)):
                await asyncio.to_thread(shutil.rmtree, old, True)
    return update


async def _push_distributed(engines: Sequence[Engine], trainer: Trainer, version: int,
                            group: WeightGroup | None) -> WeightUpdate:
    if group is None:
        raise WeightSyncError("weight_sync = \"distributed\" needs the run's weight-update "
                              "group (asyncrl.weightsync.group.WeightGroup)")
    if isinstance(trainer, AdapterTrainer) and trainer.lora_active:
        raise WeightSyncError("a LoRA adapter cannot be broadcast: SGLang loads adapters from "
                              "a directory; use weight_sync = \"disk\" with trainer.lora")
    state = await asyncio.to_thread(trainer.state_dict_for_sync)
    failed = await group.push(engines, state, version)
    for name, err in failed:
        log.error("weight_sync_failed", version=version, engine=name, error=str(err))
    if failed and len(failed) == len(engines):
        raise failed[0][1]
    return WeightUpdate(version=version, state_dict=state)


def _holds_base_of(old: Path, update: WeightUpdate) -> bool:
    """An adapter-only update leaves its base's directory in place (a re-launched server
    reloads it)."""
    return old.name == f"v{update.base_version}"


async def _payload(trainer: Trainer, version: int, mode: str, run_dir: Path) -> WeightUpdate:
    adapter = isinstance(trainer, AdapterTrainer) and trainer.lora_active
    path = run_dir / "weights" / f"v{version}"
    if not adapter:
        if mode == "disk":
            await asyncio.to_thread(trainer.export_hf, path)
            return WeightUpdate(version=version, path=str(path))
        state = await asyncio.to_thread(trainer.state_dict_for_sync)
        return WeightUpdate(version=version, state_dict=state)
    assert isinstance(trainer, AdapterTrainer)
    with_base = trainer.base_changed
    if mode == "disk":
        if with_base:
            await asyncio.to_thread(trainer.export_base, path)
        await asyncio.to_thread(trainer.export_adapter, path / "adapter")
        return WeightUpdate(version=version, path=str(path) if with_base else "",
                            adapter_path=str(path / "adapter"),
                            base_version=trainer.base_version)
    base = await asyncio.to_thread(trainer.base_state_for_sync) if with_base else None
    factors = await asyncio.to_thread(trainer.adapter_for_sync)
    return WeightUpdate(version=version, state_dict=base, adapter=factors,
                        base_version=trainer.base_version)
