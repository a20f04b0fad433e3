"""MegatronTrainer on the CPU (one process): its GRPO and SFT updates equal TorchTrainer's on
the same batch, its state restores exactly, and it exports what the engines load."""

from __future__ import annotations

import copy

import pytest
import torch
from grads import assert_grads_close, on_optimizer_step, record_grads
from mg_cases import hf_model, rl_batch, sft_examples

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig
from asyncrl.trainer.megatron import convert

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                                        "ignore::DeprecationWarning:megatron")

ALGO = dict(lr=1e-3, optimizer_steps_per_rl_step=2)  # the 2nd mini-batch sees ratio != 1
BUDGET = 64  # several micro-batches per mini-batch


def torch_trainer(hf, **algo):
    from asyncrl.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(micro_batch_tokens=BUDGET),
                        AlgorithmSection(**{**ALGO, **algo}), pad_token_id=0, temperature=0.8)


def megatron_trainer(hf, **algo):
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(copy.deepcopy(hf),
                           MegatronTrainerConfig(micro_batch_tokens=BUDGET, recompute="none"),
                           AlgorithmSection(**{**ALGO, **algo}), pad_token_id=0, temperature=0.8)


def record_megatron_grads(tr) -> list[dict[str, torch.Tensor]]:
    """The clipped gradients each optimizer step applies, under HF names and layouts."""
    names = dict(zip(map(id, tr.model.parameters()),
                     (n for n, _ in tr.model.named_parameters()), strict=True))

    def snapshot() -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        for p in tr._opt.params:
            grads.update(convert.to_hf(names[id(p)], [p.grad.clone()], tr.arch))
        return grads

    return on_optimizer_step(tr._opt.opt, snapshot)


def assert_metrics_close(mine, ref):
    assert mine.keys() == ref.keys()
    for k in ref:
        assert mine[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), k


def test_grpo_update_equals_the_torch_trainer(cpu_megatron):
    hf = hf_model("qwen3")
    tt, mt = torch_trainer(hf), megatron_trainer(hf)
    ref_grads, my_grads = record_grads(tt), record_megatron_grads(mt)
    ref_metrics = tt.train_step(rl_batch(0))
    my_metrics = mt.train_step(rl_batch(0))

    assert ref_metrics["train/micro_batches"] > 2  # packing actually split the batch
    assert ref_metrics["train/ratio_max"] > 1.0  # the second mini-batch was off-policy
    assert_grads_close(my_grads, ref_grads)
    assert_metrics_close(my_metrics, ref_metrics)
    after, before = mt.state_dict_for_sync(), hf.state_dict()
    for k, w in tt.model.state_dict().items():
        if k in after:
            assert (w - before[k]).abs().max() > 1e-4, k  # every tensor moved
            torch.testing.assert_close(after[k], w, atol=2e-5, rtol=1e-5, msg=k)


def test_sft_step_equals_the_torch_trainer(cpu_megatron):
    hf = hf_model("qwen2")  # qkv biases, untied output layer
    tt, mt = torch_trainer(hf), megatron_trainer(hf)
    ref_grads, my_grads = record_grads(tt), record_megatron_grads(mt)
    ref = tt.sft_step(sft_examples())
    mine = mt.sft_step(sft_examples())
    assert_grads_close(my_grads, ref_grads)
    assert_metrics_close(mine, ref)


def test_sft_eval_equals_the_torch_trainer(cpu_megatron):
    hf = hf_model("qwen3")
    tt, mt = torch_trainer(hf), megatron_trainer(hf)
    ref, mine = tt.sft_eval(sft_examples()), mt.sft_eval(sft_examples())
    assert mine["sft/tokens"] == ref["sft/tokens"]
    assert mine["sft/loss"] == pytest.approx(ref["sft/loss"], rel=1e-4)
    assert mt.sft_step(sft_examples())["sft/loss"] == pytest.approx(mine["sft/loss"], rel=1e-4)


def test_save_and_load_state_continue_identically(cpu_megatron, tmp_path):
    hf = hf_model("qwen3")
    a = megatron_trainer(hf, warmup_steps=3)
    a.train_step(rl_batch(0))
    a.set_lr(5e-4)
    a.save_state(tmp_path / "ckpt")
    a.train_step(rl_batch(1))
    expect = a.state_dict_for_sync()

    b = megatron_trainer(hf_model("qwen3", seed=7), warmup_steps=3)
    b.load_state(tmp_path / "ckpt")
    assert b.optimizer_step == 2
    b.train_step(rl_batch(1))
    got = b.state_dict_for_sync()
    for k in expect:
        assert torch.equal(got[k], expect[k]), k


def test_sync_state_and_export_are_hf(cpu_megatron, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = hf_model("qwen3")
    mt = megatron_trainer(hf)
    mt.train_step(rl_batch(0))
    sd = mt.state_dict_for_sync()
    mt.export_hf(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd["model.embed_tokens.weight" if k == "lm_head.weight" else k]), k
    assert back.config.tie_word_embeddings is True


def test_registry_builds_a_protocol_trainer(cpu_megatron):
    from asyncrl.trainer import TRAINER_KINDS, Trainer
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    tr = TRAINER_KINDS["megatron"](hf_model("llama"), MegatronTrainerConfig(recompute="none"),
                                   AlgorithmSection(), pad_token_id=0)
    assert isinstance(tr, MegatronTrainer) and isinstance(tr, Trainer)  # world of one: no proxy


def test_a_hf_config_alone_gives_a_randomly_initialised_trainer(cpu_megatron):
    from mg_cases import hf_config

    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    cfg = hf_config("qwen3")
    mt = MegatronTrainer(cfg, MegatronTrainerConfig(recompute="none"), AlgorithmSection(lr=1e-3),
                         pad_token_id=0)
    before = {k: v.clone() for k, v in mt.state_dict_for_sync().items()}
    assert 0.01 < before["model.layers.0.mlp.up_proj.weight"].std() < 0.03  # init_std 0.02
    assert torch.isfinite(torch.tensor(mt.train_step(rl_batch(0))["train/grad_norm"]))
    after = mt.state_dict_for_sync()
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_bf16_model_is_bf16_throughout_with_float32_masters(cpu_megatron, tmp_path):
    """No float32 norm weights beside bf16 activations: every weight of a bf16 model is bf16
    (norms included) and the optimizer's float32 master copy is what Adam updates, so a step
    smaller than bf16's resolution still accumulates; the export is the model's bf16 weights
    exactly, and a restored trainer continues bit for bit."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    def make(seed=0):
        hf = hf_model("qwen3", seed=seed).to(torch.bfloat16)
        return MegatronTrainer(hf, MegatronTrainerConfig(micro_batch_tokens=BUDGET,
                                                         recompute="selective"),
                               AlgorithmSection(lr=1e-3), pad_token_id=0)

    mt = make()
    assert {p.dtype for p in mt.model.parameters()} == {torch.bfloat16}
    masters = dict(zip(map(id, mt._opt.params), mt._opt.masters, strict=True))
    norm = mt.model.decoder.final_layernorm.weight
    assert masters[id(norm)].dtype == torch.float32
    before = {k: v.clone() for k, v in mt.state_dict_for_sync().items()}
    sft = [mt.sft_step(sft_examples())["sft/loss"] for _ in range(4)]
    assert sft[-1] < sft[0]  # it learns
    mt.train_step(rl_batch(0))
    after = mt.state_dict_for_sync()
    assert all(v.dtype == torch.bfloat16 for v in after.values())
    assert all(not torch.equal(after[k], before[k]) for k in after)
    torch.testing.assert_close(norm, masters[id(norm)].to(torch.bfloat16), atol=0, rtol=0)
    assert not torch.equal(norm.float(), masters[id(norm)])  # the master keeps the low bits

    mt.export_hf(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.dtype == torch.bfloat16
    for k, v in back.state_dict().items():
        assert torch.equal(v, after["model.embed_tokens.weight" if k == "lm_head.weight" else k])

    mt.save_state(tmp_path / "state")
    mt.train_step(rl_batch(1))
    expect = mt.state_dict_for_sync()
    mt.close()
    other = make(seed=5)
    other.load_state(tmp_path / "state")
    other.train_step(rl_batch(1))
    for k, v in other.state_dict_for_sync().items():
        assert torch.equal(v, expect[k]), k
