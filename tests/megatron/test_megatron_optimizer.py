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
