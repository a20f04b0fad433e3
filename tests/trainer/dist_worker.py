"""torchrun entry for the data-parallel equality test (not a test module).

    torchrun --nproc_per_node 2 tests/trainer/dist_worker.py OUT.pt {ddp|fsdp2} WORKDIR

Every rank builds the same tiny model and batch, takes RL steps and an SFT step through
TorchTrainer, and rank 0 writes the gradients each optimizer step applied, the final weights
and the metrics to OUT.pt. Then it exports the model to WORKDIR/hf and checks that
save_state / load_state replays a step exactly. `run(parallel)` does the same in-process (world size 1) for the
reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from trainer_batches import rl_batch, tiny_model

from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.trainer.torch_trainer import TorchTrainer, iter_params

BUDGET = 32
BATCH_SEED = 6
"""With these, rank 0 packs fewer micro-batches than rank 1 in both mini-batches, so the
dummy micro-batches that keep collectives matched are exercised."""
SFT = [([5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 1, 1, 1, 1, 1]),
       ([20, 21, 22, 23, 24], [0, 0, 1, 1, 1]),
       ([30, 31, 32], [0, 1, 1])]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def run(parallel: str, workdir: str | None = None) -> dict:
    torch.set_num_threads(1)
    tr = TorchTrainer(tiny_model(0), TorchTrainerConfig(micro_batch_tokens=BUDGET,
                                                        parallel=parallel),
                      AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2), pad_token_id=0)
    grads: list[dict[str, torch.Tensor]] = []
    step = tr.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({n: _full(p.grad) for n, p in tr.model.named_parameters()})
        return step(*args, **kwargs)

    tr.optimizer.step = recording_step
    batch = rl_batch(BATCH_SEED, groups=3, per_group=4)
    metrics = [tr.train_step(batch), tr.train_step(batch), tr.sft_step(SFT)]
    weights = {n: p.clone() for n, p in iter_params(tr.model)}
    sync = {k: _full(v) for k, v in tr.state_dict_for_sync().items()} if parallel != "fsdp2" \
        else dict(tr.state_dict_for_sync())
    sharded = any(hasattr(p, "full_tensor") for p in tr.model.parameters())
    result = {"grads": list(grads), "params": weights, "metrics": metrics, "world": tr.world_size,
              "rank": tr.rank, "sync_keys": sorted(sync), "sharded": sharded}
    if workdir is not None:
        # export, then state round trip: step, rewind, the same step again
        tr.export_hf(Path(workdir) / "hf")
        tr.save_state(Path(workdir) / "state")
        tr.train_step(batch)
        after = {n: p.clone() for n, p in iter_params(tr.model)}
        tr.load_state(Path(workdir) / "state")
        tr.train_step(batch)
        again = {n: p.clone() for n, p in iter_params(tr.model)}
        result["replay_max_diff"] = max((after[k] - again[k]).abs().max().item() for k in after)
    return result


if __name__ == "__main__":
    out_path, parallel, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    result = run(parallel, workdir)
    if result["rank"] == 0:
        torch.save(result, out_path)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
