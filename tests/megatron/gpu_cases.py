"""What a user relies on from the Megatron trainer's CUDA path (megatron's DDP and mixed-precision
/ distributed optimizer), as scenarios that take the device.

Not a test module: `test_gpu.py` runs them on a GPU; `test_megatron_optimizer.py` runs the same
code on the CPU with megatron's DDP and optimizers under `cpu_compat.cuda_as_cpu()`, so the
scenarios themselves (and the trainer's device placement around them) are exercised by the
default suite. Everything compared is first moved to the CPU: `state_dict_for_sync()` returns
CPU tensors by contract, the torch trainer's state dict lives on its device.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from mg_cases import VOCAB, hf_model, rl_batch, sft_examples

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig

LR = 1e-4


def cpu_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def fp32_update_matches_the_torch_trainer(device: str) -> None:
    """One fp32 RL step (two optimizer steps) of the Megatron trainer on megatron's distributed
    optimizer gives the torch trainer's metrics and weights."""
    from asyncrl.trainer.megatron.optimizer import MegatronOptimizer
    from asyncrl.trainer.megatron.trainer import MegatronTrainer
    from asyncrl.trainer.torch_trainer import TorchTrainer

    hf = hf_model("qwen3")
    before = cpu_state(hf.state_dict())
    algo = AlgorithmSection(lr=LR, optimizer_steps_per_rl_step=2)
    tt = TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(device=device, micro_batch_tokens=64),
                      algo, pad_token_id=0, temperature=0.8)
    mt = MegatronTrainer(copy.deepcopy(hf), MegatronTrainerConfig(micro_batch_tokens=64),
                         algo, pad_token_id=0, temperature=0.8)
    assert isinstance(mt._opt, MegatronOptimizer)
    assert mt._opt.distributed  # the default configuration
    ref, mine = tt.train_step(rl_batch(0)), mt.train_step(rl_batch(0))
    # (no clip fractions: a count that one token near the clip boundary may flip on a GPU)
    for k in ("train/loss", "train/grad_norm", "train/entropy", "train/ratio_max",
              "train/mismatch_kl"):
        assert abs(mine[k] - ref[k]) <= 1e-3 * abs(ref[k]) + 1e-6, (k, mine[k], ref[k])
    after, want = mt.state_dict_for_sync(), cpu_state(tt.model.state_dict())
    assert all(v.device.type == "cpu" for v in after.values())
    assert set(after) == set(want) - {"lm_head.weight"}  # tied: exported once
    for k, w in after.items():
        assert (w - before[k]).abs().max() > 0.5 * LR, k  # every tensor moved
        # Adam moves each weight by about lr * sign(grad): compare in units of lr, and allow
        # the few weights whose gradient is float noise to land elsewhere.
        off = ((w.float() - want[k].float()).abs() > 0.1 * LR).float().mean().item()
        assert off < 0.01, (k, off)


def bf16_distributed_optimizer_trains_and_exports(tmp_path: Path, device: str) -> None:
    """A bf16 model on megatron's distributed optimizer (selective recompute) is bf16
    throughout, learns, exports a HF checkpoint that loads in transformers with exactly its
    weights and the same log-probs, and restores from its saved state."""
    from transformers import AutoModelForCausalLM

    from asyncrl.algo.loss import token_logprobs
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron import vocab_parallel
    from asyncrl.trainer.megatron.optimizer import MegatronOptimizer
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    def make(seed: int = 0) -> MegatronTrainer:
        return MegatronTrainer(hf_model("qwen3", seed=seed).to(torch.bfloat16),
                               MegatronTrainerConfig(distributed_optimizer=True,
                                                     recompute="selective"),
                               AlgorithmSection(lr=1e-3), pad_token_id=0)

    mt = make()
    assert isinstance(mt._opt, MegatronOptimizer)
    # norms too: no float32 weight beside bf16 activations (their masters are the optimizer's)
    assert {p.dtype for p in mt.model.parameters()} == {torch.bfloat16}
    before = mt.state_dict_for_sync()
    metrics = [mt.train_step(rl_batch(0)) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(m["train/grad_norm"])) for m in metrics)
    sft = [mt.sft_step(sft_examples())["sft/loss"] for _ in range(4)]
    assert sft[-1] < sft[0]  # it learns
    after = mt.state_dict_for_sync()
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in after.values())
    assert all(not torch.equal(after[k], before[k]) for k in after)

    mt.save_state(tmp_path / "state")
    mt.export_hf(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").eval()
    assert back.dtype == torch.bfloat16
    for k, v in back.state_dict().items():
        assert torch.equal(v, after["model.embed_tokens.weight" if k == "lm_head.weight" else k]), k
    ids = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mine = vocab_parallel.token_logprobs(
            mm.forward_logits(mt.model.eval(), ids.to(mt.device)), ids.to(mt.device)).cpu()
        theirs = token_logprobs(back.to(device)(input_ids=ids.to(device)).logits, ids.to(device))
    mt.model.train()
    # same weights, different bf16 kernels: log-probs agree to bf16 rounding
    assert (mine - theirs.cpu()).abs().mean() < 0.02

    mt.train_step(rl_batch(1))
    expect = mt.state_dict_for_sync()
    mt.close()
    other = make(seed=5)
    other.load_state(tmp_path / "state")
    assert other.optimizer_step == mt.optimizer_step - 1
    other.train_step(rl_batch(1))
    for k, v in other.state_dict_for_sync().items():
        # the fp32 masters and Adam moments came back, so the next step lands where the
        # uninterrupted run's did: exactly on the CPU; on a GPU (attention backward is not
        # bitwise deterministic) but for the few weights whose gradient is float noise
        if device == "cpu":
            assert torch.equal(v, expect[k]), k
        else:
            off = ((v.float() - expect[k].float()).abs() > 1e-4).float().mean().item()
            assert off < 0.01, (k, off)
    other.close()
