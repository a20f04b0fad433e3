"""Run under torchrun (2 processes, gloo) by `test_expert_parallel.py`: a tiny Qwen3-MoE with its
experts split over 2 expert-parallel ranks (attention data parallel over the same 2 ranks);
writes results for the test to compare with one rank.

usage: torchrun --nproc_per_node 2 ep_worker.py OUT_DIR

OUT_DIR/init holds the HF model every rank starts from, OUT_DIR/replay_batch.pkl the batch with
routing records. Phases, each on every rank:
1. model: build the Megatron model (4 of the 8 experts per rank), load HF weights from disk,
   logits of the same ids on both ranks, the exported HF weights -> `model.pt` (rank 0).
2. trainer: one GRPO step (two mini-batches, each rank its data-parallel share), then
   `state_dict_for_sync` -> `step.pt`; the trainer state saved, loaded into a fresh trainer
   and exported again -> `reloaded.pt`.
3. replay: the same with `algorithm.routing_replay` on and the recorded batch -> `replay.pt`.
4. launch: rank 0 drives a fresh trainer through `launch.make_trainer`, rank 1 follows; one step
   and an export -> `export/`, `launch.pt`.
5. the CUDA optimizer path (megatron's DDP and distributed chained optimizer, run on the CPU
   under `cpu_compat.cuda_as_cpu()`): `megatron_optimizer_steps` -> `megatron_opt.pt`.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from mg_cases import rl_batch  # noqa: E402

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig  # noqa: E402
from asyncrl.trainer.megatron.cpu_compat import cpu_megatron, cuda_as_cpu  # noqa: E402

TEMPERATURE = 0.8
EP = 2


def algo(replay: bool) -> AlgorithmSection:
    return AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2, routing_replay=replay)


def config(ep: int) -> MegatronTrainerConfig:
    return MegatronTrainerConfig(expert_parallel=ep, micro_batch_tokens=64, recompute="none")


def ids() -> torch.Tensor:
    return torch.randint(2, 256, (3, 17), generator=torch.Generator().manual_seed(1))


def megatron_optimizer_steps(init: Path, state: Path, ep: int) -> dict:
    """With megatron's own optimizer: one GRPO step, the state saved, a fresh trainer resumed
    from it and a second step (another batch); the metrics and whole weights after each."""
    from asyncrl.trainer.megatron import trainer as tmod
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    saved = tmod.use_megatron_optimizer
    tmod.use_megatron_optimizer = lambda: True
    try:
        with cuda_as_cpu():
            tr = MegatronTrainer(str(init), config(ep), algo(False), pad_token_id=0,
                                 temperature=TEMPERATURE)
            first = tr.train_step(rl_batch(0)), tr.state_dict_for_sync()
            tr.save_state(state)
            del tr
            again = MegatronTrainer(str(init), config(ep), algo(False), pad_token_id=0,
                                    temperature=TEMPERATURE)
            again.load_state(state)
            second = again.train_step(rl_batch(1)), again.state_dict_for_sync()
            kind = type(again._opt.opt).__name__
    finally:
        tmod.use_megatron_optimizer = saved
    return {"first": first, "second": second, "optimizer": kind}


def main(out: Path) -> None:
    from transformers import AutoConfig

    from asyncrl.trainer.megatron import launch
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron.arch import Arch
    from asyncrl.trainer.megatron.hf_files import HFReader
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    init = out / "init"

    # 1. model
    arch = Arch.from_hf(AutoConfig.from_pretrained(init))
    layout = mm.init_parallel(1, 1, seed=0, ep=EP)
    model = mm.build_gpt(arch)
    mm.load_hf_weights(model, arch, HFReader(init))
    local = len(model.decoder.layers[0].mlp.experts.local_experts)
    with torch.no_grad():
        logits = mm.forward_logits(model.eval(), ids())
    weights = dict(mm.iter_hf_weights(model, arch))
    if layout.rank == 0:
        torch.save({"logits": logits, "weights": weights, "local_experts": local,
                    "layout": vars(layout) | {"device": "cpu"}}, out / "model.pt")
    del model

    # 2. trainer, called on every rank
    tr = MegatronTrainer(str(init), config(EP), algo(False), pad_token_id=0,
                         temperature=TEMPERATURE)
    metrics = tr.train_step(rl_batch(0))
    sync = tr.state_dict_for_sync()
    tr.save_state(out / "state")
    del tr
    again = MegatronTrainer(str(init), config(EP), algo(False), pad_token_id=0,
                            temperature=TEMPERATURE)
    again.load_state(out / "state")
    reloaded = again.state_dict_for_sync()
    if layout.rank == 0:
        torch.save({"metrics": metrics, "sync": sync}, out / "step.pt")
        torch.save({"sync": reloaded, "opt_step": again.optimizer_step}, out / "reloaded.pt")
    del again

    # 3. routing replay
    batch = pickle.loads((out / "replay_batch.pkl").read_bytes())
    tr = MegatronTrainer(str(init), config(EP), algo(True), pad_token_id=0,
                         temperature=TEMPERATURE)
    metrics = tr.train_step(batch)
    sync = tr.state_dict_for_sync()
    if layout.rank == 0:
        torch.save({"metrics": metrics, "sync": sync}, out / "replay.pt")
    del tr

    # 4. launch: the event-loop rank drives, the other follows
    if layout.rank == 0:
        proxy = launch.make_trainer(str(init), config(EP), algo(False), pad_token_id=0,
                                    temperature=TEMPERATURE)
        m = proxy.train_step(rl_batch(0))
        proxy.export_hf(out / "export")
        sync = proxy.state_dict_for_sync()
        proxy.close()
        torch.save({"metrics": m, "sync": sync}, out / "launch.pt")
    else:
        launch.follow()

    # 5. megatron's DDP and distributed optimizer (the CUDA path)
    got = megatron_optimizer_steps(init, out / "megatron_state", EP)
    if layout.rank == 0:
        torch.save(got, out / "megatron_opt.pt")
    mm.destroy_parallel()


if __name__ == "__main__":
    with cpu_megatron():
        main(Path(sys.argv[1]))
