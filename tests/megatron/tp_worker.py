"""Run under torchrun (2 processes, gloo) by `test_parallel.py`; writes results for it to check.

usage: torchrun --nproc_per_node 2 tp_worker.py OUT_DIR TP

OUT_DIR/init holds the HF model every rank starts from. Three phases, each on every rank:
1. model: build the Megatron model (TP shards), load HF weights from disk, compute log-probs,
   entropy and the gathered HF weights -> `model.pt` (rank 0).
2. trainer: every rank runs `MegatronTrainer.train_step` on the same batch and records the
   clipped gradient shards of each optimizer step -> `grads_rank{r}.pt`, metrics (rank 0).
3. launch: rank 0 drives a fresh trainer through `launch.make_trainer` (the registry's proxy),
   the other rank runs `launch.follow()`; rank 0 trains one step and exports -> `export/`.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from mg_cases import VOCAB, rl_batch  # noqa: E402

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig  # noqa: E402
from asyncrl.trainer.megatron.cpu_compat import cpu_megatron  # noqa: E402

ALGO = AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2)
TEMPERATURE = 0.8


def main(out: Path, tp: int) -> None:
    from transformers import AutoConfig

    from asyncrl.trainer.megatron import launch, vocab_parallel
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron.arch import Arch
    from asyncrl.trainer.megatron.hf_files import HFReader
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = MegatronTrainerConfig(tensor_parallel=tp, micro_batch_tokens=64, recompute="none")
    init = out / "init"

    # 1. model
    arch = Arch.from_hf(AutoConfig.from_pretrained(init))
    layout = mm.init_parallel(tp, 1, seed=0)
    model = mm.build_gpt(arch)
    mm.load_hf_weights(model, arch, HFReader(init))
    ids = torch.randint(0, VOCAB, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = mm.forward_logits(model.eval(), ids)
        lp = vocab_parallel.token_logprobs(logits, ids, TEMPERATURE)
        ent = vocab_parallel.token_entropy(logits, TEMPERATURE)
    weights = dict(mm.iter_hf_weights(model, arch))
    if layout.rank == 0:
        torch.save({"ids": ids, "logprobs": lp, "entropy": ent, "weights": weights,
                    "vocab_shard": logits.shape[-1], "layout": vars(layout) | {"device": "cpu"}},
                   out / "model.pt")
    del model

    # 2. trainer, called on every rank
    tr = MegatronTrainer(str(init), cfg, ALGO, pad_token_id=0, temperature=TEMPERATURE)
    steps: list[dict[str, torch.Tensor]] = []
    names = {id(p): n for n, p in tr.model.named_parameters()}
    step, params = tr._opt.opt.step, tr._opt.params

    def recording(*a, **k):
        steps.append({names[id(p)]: p.grad.clone() for p in params})
        return step(*a, **k)

    tr._opt.opt.step = recording
    metrics = tr.train_step(rl_batch(0))
    torch.save({"tp_rank": tr.layout.tp_rank, "dp_rank": tr.layout.dp_rank, "steps": steps},
               out / f"grads_rank{layout.rank}.pt")
    if layout.rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics))
    del tr

    # 3. launch: the event-loop rank drives, the other follows
    if layout.rank == 0:
        proxy = launch.make_trainer(str(init), cfg, ALGO, pad_token_id=0,
                                    temperature=TEMPERATURE)
        m = proxy.train_step(rl_batch(0))
        proxy.export_hf(out / "export")
        sync = proxy.state_dict_for_sync()
        proxy.close()
        (out / "launch_metrics.json").write_text(json.dumps(m))
        torch.save(sync, out / "launch_sync.pt")
    else:
        launch.follow()
    mm.destroy_parallel()


if __name__ == "__main__":
    with cpu_megatron():
        main(Path(sys.argv[1]), int(sys.argv[2]))
