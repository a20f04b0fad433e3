"""Routing replay in the torch trainer (`asyncrl.trainer.moe_replay`), measured on rollouts the
local engine sampled from a tiny Qwen3-MoE: the trainer's log-probs of the sampled tokens
against the engine's, with and without replay, and with the records shuffled.

The engine's routers hold bf16-rounded weights (everything else is the trainer's fp32 model):
the precision gap of an SGLang server's bf16 router against a trainer's fp32 router, confined
to the routing, so that replay has something to remove. With identical fp32 weights on both
sides no routing decision flips and replay must change nothing (tested too)."""

from __future__ import annotations

import copy

import pytest
import torch
from moe_cases import one_batch, sample_rollouts, shuffled

from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.errors import ConfigError
from asyncrl.trainer.torch_trainer import TorchTrainer


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _mismatch(model, tok, rollouts, replay: bool, share: bool = True
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """|trainer log-prob - engine log-prob| of every sampled token, and the replay metrics."""
    tr = TorchTrainer(copy.deepcopy(model), TorchTrainerConfig(share_prefixes=share),
                      AlgorithmSection(routing_replay=replay), pad_token_id=tok.pad_token_id)
    diffs = []
    with torch.no_grad():
        for mb in tr.plan(batching.sequences_from_batch(one_batch(rollouts))):
            t = tr.tensors(mb)
            lp = tr.logprobs(t, 1.0)
            on = t["mask"] > 0
            diffs.append((lp[on] - t["sampling_logprobs"][on]).abs())
    return torch.cat(diffs), (tr.replay.metrics() if tr.replay is not None else {})


@pytest.fixture(scope="module")
def moe(tiny_moe_factory):
    return tiny_moe_factory(0)


@pytest.fixture(scope="module")
def gap_rollouts(moe, tiny_tokenizer):
    return sample_rollouts(moe, tiny_tokenizer, bf16_router=True)


def test_replay_brings_the_trainer_to_the_engines_logprobs(moe, tiny_tokenizer, gap_rollouts):
    free, none = _mismatch(moe, tiny_tokenizer, gap_rollouts, replay=False)
    replayed, m = _mismatch(moe, tiny_tokenizer, gap_rollouts, replay=True)
    assert none == {}
    # Some decisions flip (a fraction of a percent of (token, layer) pairs), and those
    # tokens carry most of the mismatch: replay removes them.
    assert 0 < m["train/routing_replay_changed"] < 0.05
    assert m["train/routing_replay_tokens"] >= 2 * free.numel()
    assert free.mean() > 3 * replayed.mean(), (free.mean(), replayed.mean())
    assert free.max() > 10 * replayed.max(), (free.max(), replayed.max())


def test_shuffled_records_break_the_match(moe, tiny_tokenizer, gap_rollouts):
    free, _ = _mismatch(moe, tiny_tokenizer, gap_rollouts, replay=False)
    wrong, m = _mismatch(moe, tiny_tokenizer, shuffled(gap_rollouts), replay=True)
    assert m["train/routing_replay_changed"] > 0.5
    assert wrong.mean() > 20 * free.mean()


@pytest.mark.parametrize("share", [True, False])
def test_same_weights_replay_changes_nothing(moe, tiny_tokenizer, share):
    """fp32 on both sides: no decision flips, so replay is exact and changes no log-prob, in
    the shared-prefix layout and in plain rows alike (the records line up with positions)."""
    rollouts = sample_rollouts(moe, tiny_tokenizer, bf16_router=False)
    free, _ = _mismatch(moe, tiny_tokenizer, rollouts, replay=False, share=share)
    replayed, m = _mismatch(moe, tiny_tokenizer, rollouts, replay=True, share=share)
    assert m["train/routing_replay_changed"] == 0.0
    assert replayed.max() < 1e-4 and free.max() < 1e-4


def test_train_step_with_replay_updates_experts_and_router(moe, tiny_tokenizer, gap_rollouts):
    model = copy.deepcopy(moe)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr = TorchTrainer(model, TorchTrainerConfig(), AlgorithmSection(lr=1e-3),
                      pad_token_id=tiny_tokenizer.pad_token_id)
    assert tr.replay is not None  # on by default for an MoE model
    ros = copy.deepcopy(gap_rollouts)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(ros))]
    batch = one_batch(ros)
    batch.groups[0].advantages = advantages
    out = tr.train_step(batch)
    assert 0 < out["train/routing_replay_changed"] < 0.05
    after = model.state_dict()
    for key in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        assert not torch.equal(before[key], after[key]), key


def test_forced_on_a_dense_model_is_refused(tiny_model_factory, tiny_tokenizer):
    with pytest.raises(ConfigError, match="routing_replay"):
        TorchTrainer(tiny_model_factory(0), TorchTrainerConfig(),
                     AlgorithmSection(routing_replay=True),
                     pad_token_id=tiny_tokenizer.pad_token_id)
    tr = TorchTrainer(tiny_model_factory(0), TorchTrainerConfig(), AlgorithmSection(),
                      pad_token_id=tiny_tokenizer.pad_token_id)
    assert tr.replay is None


@pytest.mark.parametrize("share", [True, False])
def test_deliberate_flips_are_reproduced_exactly(moe, tiny_tokenizer, share):
    """The engine's routers choose other experts for many tokens (its choice by noisy weights,
    its expert weights the model's own): replaying the records, the trainer over the same fp32
    weights reproduces the engine's log-probs, so every record lines up with its token (no
    offset, padding or shared-prefix slip) and the gate weights are computed as the engine's."""
    rollouts = sample_rollouts(moe, tiny_tokenizer, bf16_router=False, other_choice=0.1)
    free, _ = _mismatch(moe, tiny_tokenizer, rollouts, replay=False, share=share)
    replayed, m = _mismatch(moe, tiny_tokenizer, rollouts, replay=True, share=share)
    assert m["train/routing_replay_changed"] > 0.1
    assert replayed.max() < 1e-4, replayed.max()
    assert free.mean() > 1e-2


def test_reference_replays_so_the_kl_before_the_first_update_is_zero(moe, tiny_tokenizer,
                                                                      gap_rollouts):
    """With `kl_coef`, the frozen reference routes the recorded experts as the policy does:
    before any update the two are the same model, so the KL penalty is zero."""
    tr = TorchTrainer(copy.deepcopy(moe), TorchTrainerConfig(),
                      AlgorithmSection(lr=1e-3, kl_coef=0.1),
                      pad_token_id=tiny_tokenizer.pad_token_id)
    out = tr.train_step(one_batch(copy.deepcopy(gap_rollouts)))
    assert out["train/routing_replay_changed"] > 0
    assert abs(out["train/kl_ref"]) < 1e-9, out["train/kl_ref"]
