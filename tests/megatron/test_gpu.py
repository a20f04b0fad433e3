"""The Megatron trainer's CUDA path (megatron DDP + megatron optimizer), on a GPU machine:
`pytest -m gpu tests/megatron`. Throughput and MFU: `python bench/megatron_step.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from mg_cases import hf_model, rl_batch, sft_examples

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                               "ignore::DeprecationWarning:megatron"),
]

LR = 1e-4


@pytest.fixture
def megatron_gpu():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fp32_update_matches_the_torch_trainer_on_cuda(megatron_gpu):
    from asyncrl.trainer.megatron.trainer import MegatronTrainer, _MegatronOptimizer
    from asyncrl.trainer.torch_trainer import TorchTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model("qwen3")
    algo = AlgorithmSection(lr=LR, optimizer_steps_per_rl_step=2)
    tt = TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(device="cuda", micro_batch_tokens=64),
                      algo, pad_token_id=0, temperature=0.8)
    mt = MegatronTrainer(copy.deepcopy(hf), MegatronTrainerConfig(micro_batch_tokens=64),
                         algo, pad_token_id=0, temperature=0.8)
    assert isinstance(mt._opt, _MegatronOptimizer)
    ref, mine = tt.train_step(rl_batch(0)), mt.train_step(rl_batch(0))
    for k in ("train/loss", "train/grad_norm", "train/entropy", "train/ratio_max"):
        assert mine[k] == pytest.approx(ref[k], rel=1e-3), k
    after, want = mt.state_dict_for_sync(), tt.model.state_dict()
    for k, w in after.items():
        # Adam moves each weight by about lr * sign(grad): compare in units of lr, and allow
        # the few weights whose gradient is float noise to land elsewhere.
        off = ((w.float() - want[k].float()).abs() > 0.1 * LR).float().mean().item()
        assert off < 0.01, (k, off)


def test_bf16_distributed_optimizer_trains_and_exports(megatron_gpu, tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    hf = hf_model("qwen3").to(torch.bfloat16)
    mt = MegatronTrainer(hf, MegatronTrainerConfig(distributed_optimizer=True,
                                                   recompute="selective"),
                         AlgorithmSection(lr=1e-3), pad_token_id=0)
    before = mt.state_dict_for_sync()
    before = {k: v.clone() for k, v in before.items()}
    metrics = [mt.train_step(rl_batch(0)) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(m["train/grad_norm"])) for m in metrics)
    sft = [mt.sft_step(sft_examples())["sft/loss"] for _ in range(4)]
    assert sft[-1] < sft[0]  # it learns
    after = mt.state_dict_for_sync()
    assert all(not torch.equal(after[k], before[k]) for k in after)
    mt.save_state(tmp_path / "state")
    mt.export_hf(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.state_dict()["model.norm.weight"].cuda(), after["model.norm.weight"])


def test_export_loads_in_sglang(megatron_gpu, tmp_path):
    sglang = pytest.importorskip("sglang", reason="SGLang is not installed")
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    hf = hf_model("qwen3").to(torch.bfloat16)
    mt = MegatronTrainer(hf, MegatronTrainerConfig(), AlgorithmSection(), pad_token_id=0)
    mt.export_hf(tmp_path)
    engine = sglang.Engine(model_path=str(tmp_path), skip_tokenizer_init=True,
                           mem_fraction_static=0.2, disable_cuda_graph=True)
    try:
        ids = [5, 17, 42, 99, 3]
        out = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 8,
                                                                "temperature": 0.0})
        expect = hf.cuda().generate(torch.tensor([ids]).cuda(), max_new_tokens=8,
                                    do_sample=False)[0, len(ids):].tolist()
        got = out[0]["output_ids"]
        assert len(got) > 0 and got[:2] == expect[:2]  # bf16 kernels may diverge later
    finally:
        engine.shutdown()
