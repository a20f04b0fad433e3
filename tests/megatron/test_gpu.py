"""The Megatron trainer's CUDA path (megatron DDP + megatron optimizer), on a GPU machine:
`pytest -m gpu tests/megatron`. The scenarios are `gpu_cases`' (the default suite runs them on
the CPU too: `test_megatron_optimizer.py`). Throughput and MFU: `python bench/megatron_step.py`."""

from __future__ import annotations

import gpu_cases
import pytest
import torch
from mg_cases import hf_model

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                               "ignore::DeprecationWarning:megatron"),
]


@pytest.fixture
def megatron_gpu():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fp32_update_matches_the_torch_trainer_on_cuda(megatron_gpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    gpu_cases.fp32_update_matches_the_torch_trainer("cuda")


def test_bf16_distributed_optimizer_trains_and_exports(megatron_gpu, tmp_path):
    gpu_cases.bf16_distributed_optimizer_trains_and_exports(tmp_path, "cuda")


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
