"""Routing replay in the Megatron trainer beyond the policy's forward
(`tests/megatron/test_moe.py` has the policy's mismatch test): the frozen reference model
(`algorithm.kl_coef`) replays the records too, and deliberate flips are reproduced exactly.
Rollouts are sampled by the local engine from the tiny Qwen3-MoE (`tests/moe_cases.py`)."""

from __future__ import annotations

import copy

import pytest
import torch
from moe_cases import one_batch, sample_rollouts, shuffled

from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, MegatronTrainerConfig


@pytest.fixture(scope="module")
def moe(tiny_moe_factory):
    return tiny_moe_factory(0)


@pytest.fixture(scope="module")
def gap_rollouts(moe, tiny_tokenizer):
    """Sampled with the engine's routers in bf16: a fraction of a percent of decisions flip."""
    return sample_rollouts(moe, tiny_tokenizer, bf16_router=True)


def _trainer(model, tok, **algo):
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(copy.deepcopy(model), MegatronTrainerConfig(recompute="none"),
                           AlgorithmSection(**algo), pad_token_id=tok.pad_token_id)


def _logprobs(mt, rollouts, reference: bool = False):
    """(trainer log-probs, engine log-probs) of every sampled token."""
    got, want = [], []
    with torch.no_grad():
        for mb in mt.plan(batching.sequences_from_batch(one_batch(rollouts))):
            t = mt.tensors(mb)
            on = t["mask"] > 0
            lp = mt.reference_logprobs(t, 1.0) if reference else mt.logprobs(t, 1.0)
            got.append(lp[on])
            want.append(t["sampling_logprobs"][on])
    return torch.cat(got), torch.cat(want)


def test_the_reference_model_replays_the_records(cpu_megatron, moe, tiny_tokenizer,
                                                 gap_rollouts):
    """The reference's log-probs under replay are the replayed policy's (same weights, same
    routing), closer to the engine's than the router's own choice gives, and shuffled records
    move them far off."""
    free, engine = _logprobs(_trainer(moe, tiny_tokenizer, routing_replay=False), gap_rollouts)
    mt = _trainer(moe, tiny_tokenizer, routing_replay=True, kl_coef=0.1)
    ref, _ = _logprobs(mt, gap_rollouts, reference=True)
    policy, _ = _logprobs(mt, gap_rollouts)
    torch.testing.assert_close(ref, policy, atol=1e-6, rtol=0)
    free_d, ref_d = (free - engine).abs(), (ref - engine).abs()
    assert free_d.mean() > 3 * ref_d.mean(), (free_d.mean(), ref_d.mean())
    assert free_d.max() > 10 * ref_d.max(), (free_d.max(), ref_d.max())
    wrong, _ = _logprobs(mt, shuffled(gap_rollouts), reference=True)
    assert (wrong - engine).abs().mean() > 20 * free_d.mean()


def test_the_kl_to_the_reference_before_the_first_update_is_zero(cpu_megatron, moe,
                                                                 tiny_tokenizer, gap_rollouts):
    """Policy and reference are the same model before the first update: with both replaying,
    the KL penalty is zero; had the reference routed on its own, the flipped tokens would
    show up as KL. Both models' replayed pairs count in the step's metric."""
    mt = _trainer(moe, tiny_tokenizer, routing_replay=True, kl_coef=0.1, lr=1e-3)
    out = mt.train_step(one_batch(copy.deepcopy(gap_rollouts)))
    assert out["train/routing_replay_changed"] > 0
    assert abs(out["train/kl_ref"]) < 1e-9, out["train/kl_ref"]
    plain = _trainer(moe, tiny_tokenizer, routing_replay=True, lr=1e-3)
    tokens = plain.train_step(one_batch(copy.deepcopy(gap_rollouts)))["train/routing_replay_tokens"]
    assert out["train/routing_replay_tokens"] > tokens


def test_deliberate_flips_are_reproduced_exactly(cpu_megatron, moe, tiny_tokenizer):
    """The engine's routers choose other experts for many tokens (`moe_cases.sample_rollouts`
    `other_choice`): megatron-core's router replay with the records reproduces the engine's
    log-probs over the same fp32 weights (records in megatron's position-major order, gate
    weights as the engine's: softmax over the recorded top-k)."""
    rollouts = sample_rollouts(moe, tiny_tokenizer, bf16_router=False, other_choice=0.1)
    free, engine = _logprobs(_trainer(moe, tiny_tokenizer, routing_replay=False), rollouts)
    mt = _trainer(moe, tiny_tokenizer, routing_replay=True)
    replayed, _ = _logprobs(mt, rollouts)
    changed, compared = (float(x) for x in mt.replay.take_counts())
    assert changed > 0.1 * compared
    assert (replayed - engine).abs().max() < 1e-4, (replayed - engine).abs().max()
    assert (free - engine).abs().mean() > 1e-2
