"""Pushing one weight version into engines: the side of a weight update that is not a server's.

Owns: `push_weights`, the train loop's whole push (the trainer's weights as an HF directory,
an in-memory state dict, or a broadcast over the run's `weight_group.WeightGroup`, as
`engine.weight_sync` says; every engine; the run goes on while
one engine took them; older exported versions removed), fanning an update out to several engines (`push_to_all`: concurrently; one engine's
`WeightSyncError` does not stop the others, and the failures are returned by name, since a
failed engine keeps serving its old weights under its old version tags), and running the
trainer's part of a collective sync alongside the server's call (`with_peer`: both sides block
until every rank arrives, so they run together; the first failure ends both).

Does not own: the update sequence of one server (pause, apply, flush, version, resume:
`remote.RemoteEngine`), any server's weight endpoints (`sglang_weights`, `vllm`), or the
trainer's state dict, export and collectives (the train loop passes them in as an update or
as the `peer` callable), or the distributed mode's process group (`weight_group`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.engine.base import WeightUpdate
from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.log import get_logger
from asyncrl.trainer.base import AdapterTrainer

if TYPE_CHECKING:
    from asyncrl.engine.weight_group import WeightGroup
    from asyncrl.trainer.base import Trainer

log = get_logger(__name__)


async def push_weights(engines: Sequence[Any], trainer: Trainer, version: int,
                       mode: str, run_dir: Path, group: WeightGroup | None = None
                       ) -> WeightUpdate:
    """The trainer's current weights to every engine as `version`.

    "disk": the trainer exports an HF directory `run_dir/weights/v{version}` and the engines
    load it from there (older `v*` directories are removed once they have); "tensor": the
    trainer's full state dict, in memory; "distributed": the state dict broadcast over
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
    if isinstance(trainer, AdapterTrainer) and trainer.lora_active and update.has_base:
        # An engine that missed this base must get it again with the next adapter.
        trainer.base_changed = bool(failed)
        trainer.base_version = version
    if update.path or update.adapter_path:
        root = Path(run_dir) / "weights"
        for old in root.glob("v*"):
            if old.name != f"v{version}" and (update.has_base or not _holds_base_of(old, update)):
                await asyncio.to_thread(shutil.rmtree, old, True)
    return update


async def _push_distributed(engines: Sequence[Any], trainer: Trainer, version: int,
                            group: WeightGroup | None) -> WeightUpdate:
    if group is None:
        raise WeightSyncError("weight_sync = \"distributed\" needs the run's weight-update "
                              "group (asyncrl.engine.weight_group.WeightGroup)")
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


async def push_to_all(engines: Sequence[Any], update: WeightUpdate
                      ) -> list[tuple[str, WeightSyncError]]:
    """`update` to every engine at once; (name, error) of each engine whose update failed.

    Waits for every engine; then an error that is not a `WeightSyncError` (a bug, a
    cancellation) is raised, the first in `engines` order.
    """
    results = await asyncio.gather(*(e.update_weights(update) for e in engines),
                                   return_exceptions=True)
    failed = [(e.name, r) for e, r in zip(engines, results, strict=True)
              if isinstance(r, BaseException)]
    for _, r in failed:
        if not isinstance(r, WeightSyncError):
            raise r
    return [(n, r) for n, r in failed if isinstance(r, WeightSyncError)]


async def with_peer(server_call: Awaitable[Any],
                    peer: Callable[[], Awaitable[None]] | None) -> None:
    """Run the server's call and the trainer's side (`peer`) together; the first failure is
    raised as itself (a trainer-side failure as `WeightSyncError`), the other side is
    cancelled."""
    async def trainer_side() -> None:
        assert peer is not None
        try:
            await peer()
        except (EngineError, WeightSyncError, asyncio.CancelledError):
            raise
        except Exception as e:  # the trainer's collective: any failure ends the update
            raise WeightSyncError(f"trainer side of the weight sync failed: {e!r}") from e

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server_call)  # type: ignore[arg-type]
            if peer is not None:
                tg.create_task(trainer_side())
    except BaseExceptionGroup as eg:
        first = next((e for e in eg.exceptions
                      if not isinstance(e, asyncio.CancelledError)), eg.exceptions[0])
        raise first from None
