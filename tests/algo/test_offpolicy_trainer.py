"""The torch trainer applies `algorithm.correction` and sees each token's version lag."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algo import batching
from asyncrl.algo.loss import token_logprobs
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.records import Batch, Group, Problem, Rollout
from asyncrl.trainer.torch_trainer import TorchTrainer


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16,
                               max_position_embeddings=128, tie_word_embeddings=True,
                               vocab_size=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _batch() -> Batch:
    """Two groups sampled one version before the trainer's (lag 1 on every token), with
    sampling log-probs the trainer's own are far from (w = pi_prox / mu != 1)."""
    rng = random.Random(0)
    groups = []
    for g in range(2):
        rollouts = []
        for i in range(2):
            n = 6
            rollouts.append(Rollout(
                rollout_id=f"{g}{i}", prompt_id=str(g), group_id=str(g), policy_version=1,
                prompt_ids=[1, 2, 3], response_ids=[rng.randrange(4, 64) for _ in range(n)],
                loss_mask=[1] * n, logprobs=[-3.0] * n, token_versions=[1] * n,
                reward=float(i)))
        groups.append(Group(group_id=str(g), problem=Problem(id=str(g), question="q",
                                                              answer="1"),
                            rollouts=rollouts, kept=[0, 1], advantages=[-1.0, 1.0]))
    return Batch(step=1, policy_version=2, groups=groups)


def _trainer(**algo) -> TorchTrainer:
    return TorchTrainer(_model(), TorchTrainerConfig(micro_batch_tokens=4096),
                        AlgorithmSection(lr=1e-2, weight_decay=0.0, **algo), pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_loss_sees_each_tokens_lag_and_the_mismatch():
    out = _trainer().train_step(_batch())
    assert out["train/stale_token_frac"] == 1.0 and out["train/version_lag_max"] == 1.0
    assert out["train/corr_coef"] == 1.0 and out["train/corr_masked_frac"] == 0.0
    assert out["train/mismatch_kl"] > 0
    assert out["train/mismatch_ratio_p01"] <= out["train/mismatch_ratio_p50"] \
        <= out["train/mismatch_ratio_p99"]


def test_decoupled_weights_tokens_by_pi_prox_over_mu():
    tr = _trainer(correction="decoupled")
    seqs = batching.sequences_from_batch(_batch())
    with torch.no_grad():  # the weights expected: exp(trainer logp - sampling logp), mean
        ws = []
        for s in seqs:
            ids = torch.tensor([s.input_ids])
            lp = token_logprobs(tr.model(input_ids=ids, use_cache=False).logits, ids)[0]
            ws += [math.exp(float(lp[t]) - s.sampling_logprobs[t])
                   for t in range(len(s.input_ids)) if s.loss_mask[t]]
    out = tr.train_step(_batch())
    assert out["train/corr_coef"] == pytest.approx(sum(ws) / len(ws), rel=1e-4)


def test_icepop_masking_every_token_leaves_the_weights_unchanged():
    tr = _trainer(correction="icepop", icepop_low=0.999, icepop_high=1.001)
    before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
    out = tr.train_step(_batch())
    assert out["train/corr_masked_frac"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in tr.model.named_parameters())
    moved = _trainer(correction="none")
    ref = {k: v.detach().clone() for k, v in moved.model.named_parameters()}
    moved.train_step(_batch())
    assert any(not torch.equal(ref[k], v) for k, v in moved.model.named_parameters())
