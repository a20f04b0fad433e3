"""The Megatron trainer's CUDA optimizer path, megatron's own DDP and mixed-precision /
distributed optimizer, run on the CPU under `cpu_compat.cuda_as_cpu()`: the same scenarios as
the GPU tests (`gpu_cases`), so they, and the trainer code around that optimizer, are checked by
the default suite."""

from __future__ import annotations

import gpu_cases
import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                                        "ignore::DeprecationWarning:megatron")


@pytest.fixture
def megatron_optimizer(cpu_megatron, monkeypatch):
    from asyncrl.trainer.megatron import trainer
    from asyncrl.trainer.megatron.cpu_compat import cuda_as_cpu

    monkeypatch.setattr(trainer, "use_megatron_optimizer", lambda: True)
    with cuda_as_cpu():
        yield


def test_fp32_distributed_optimizer_update_matches_the_torch_trainer(megatron_optimizer):
    gpu_cases.fp32_update_matches_the_torch_trainer("cpu")


def test_bf16_distributed_optimizer_trains_exports_and_resumes(megatron_optimizer, tmp_path):
    gpu_cases.bf16_distributed_optimizer_trains_and_exports(tmp_path, "cpu")


def test_fp32_distributed_optimizer_resumes_where_it_stopped(megatron_optimizer, tmp_path):
    """An fp32 model's distributed-optimizer state loads back (its main params are views of
    the model's, which megatron's loader copies into in place: outside no_grad autograd
    refused it), and the resumed step equals the uninterrupted one."""
    import copy

    import torch
    from mg_cases import hf_model, rl_batch

    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    hf = hf_model("qwen3")
    cfg = MegatronTrainerConfig(micro_batch_tokens=64, recompute="none")
    algo = AlgorithmSection(lr=1e-3, optimizer_steps_per_rl_step=2)
    first = MegatronTrainer(copy.deepcopy(hf), cfg, algo, pad_token_id=0)
    first.train_step(rl_batch(0))
    first.save_state(tmp_path / "state")
    first.train_step(rl_batch(1))
    want = first.state_dict_for_sync()
    resumed = MegatronTrainer(copy.deepcopy(hf), cfg, algo, pad_token_id=0)
    resumed.load_state(tmp_path / "state")
    assert resumed.optimizer_step == 2
    resumed.train_step(rl_batch(1))
    got = resumed.state_dict_for_sync()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
