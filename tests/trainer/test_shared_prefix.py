"""Shared prefixes computed once (`trainer.share_prefixes`, `asyncrl.trainer.shared_prefix`):
a GRPO group's samples packed as one run, its prompt laid out once, give the same log-probs,
metrics and gradients as one row per sequence, RL and SFT, with sdpa and eager attention, while
the model runs on fewer positions."""

from __future__ import annotations

import copy

import pytest
import torch
from grads import assert_grads_close, record_grads
from trainer_batches import TINY, rl_batch, tiny_model

from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.trainer import lm_head
from asyncrl.trainer.torch_trainer import SHARED_MIN_TOKENS, TorchTrainer

TEMPERATURE = 0.7
PROMPT = (SHARED_MIN_TOKENS + 4, SHARED_MIN_TOKENS + 12)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(model=None, budget: int = 4096, **algo) -> tuple[TorchTrainer, TorchTrainer]:
    """(shared, one row per sequence) trainers over copies of the same model."""
    model = model if model is not None else tiny_model(0)
    return tuple(  # type: ignore[return-value]
        TorchTrainer(copy.deepcopy(model),
                     TorchTrainerConfig(micro_batch_tokens=budget, share_prefixes=share),
                     AlgorithmSection(**{"lr": 1e-3, **algo}), pad_token_id=0,
                     temperature=TEMPERATURE)
        for share in (True, False))


def positions(tr: TorchTrainer) -> list[int]:
    """Input positions of each forward of the model (rows x width)."""
    seen: list[int] = []
    tr.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen


def batch(seed: int = 2, **kw):
    return rl_batch(seed, groups=3, per_group=4, prompt=PROMPT, system=10, **kw)


def test_groups_are_packed_as_runs_of_their_prompt():
    shared, plain = pair(budget=4096)
    seqs = batching.sequences_from_batch(batch())
    (mb,) = shared.plan(seqs)
    assert mb.shared_prefix.count(0) == 3  # one run per group, not one of the system text
    prompts = {len(s.input_ids) - len(r.response_ids)
               for s, (r, _) in zip(seqs, batch().rollouts(), strict=True)}
    assert set(mb.shared_prefix) - {0} <= {p + k for p in prompts for k in range(3)}
    assert plain.plan(seqs)[0].shared_prefix == []


@pytest.mark.parametrize("minis", [1, 2])
def test_rl_steps_equal_one_row_per_sequence(minis):
    """Old log-probs (fused and separate), KL reference, TIS, mismatch, ratio quantiles,
    entropy: every metric and every gradient as without sharing, on fewer positions."""
    shared, plain = pair(budget=160, optimizer_steps_per_rl_step=minis, kl_coef=0.05,
                         correction="tis")
    gs, gp = record_grads(shared), record_grads(plain)
    ps, pp = positions(shared), positions(plain)
    for _ in range(2):
        ms, mp = shared.train_step(batch()), plain.train_step(batch())
    assert len(gs) == len(gp) == 2 * minis
    assert ms.keys() == mp.keys() and "train/kl_ref" in ms and ms["train/tokens"] > 0
    for k, v in mp.items():
        if k != "train/micro_batches":
            assert ms[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert all(a.keys() == b.keys() for a, b in zip(gs, gp, strict=True))
    assert_grads_close(gs, gp, atol=1e-6)
    assert sum(ps) < 0.75 * sum(pp)  # the same passes, each prompt laid out once


def test_eager_attention_and_a_sequence_that_is_all_prefix():
    """The additive mask works with eager attention too, and a sequence whose tokens are all
    in the shared part (here: one whose response is a prefix of another's) still trains."""
    model = tiny_model(0)
    model.config._attn_implementation = "eager"
    shared, plain = pair(model)
    b = batch(3)
    group = b.groups[0]
    first, second = group.rollouts[0], group.rollouts[1]
    group.rollouts[1] = type(second)(**{**{f: getattr(second, f) for f in second.__struct_fields__},
                                        "response_ids": first.response_ids[:3],
                                        "loss_mask": [1, 1, 1], "logprobs": [-4.5] * 3})
    (mb,) = shared.plan(batching.sequences_from_batch(b))
    assert any(mb.shared_prefix) and shared.tensors(mb)["pack_mask"].dtype == model.dtype
    ms, mp = shared.train_step(b), plain.train_step(b)
    for k in ("train/loss", "train/entropy", "train/grad_norm", "train/tokens"):
        assert ms[k] == pytest.approx(mp[k], rel=1e-4, abs=1e-6), k


def test_sft_examples_with_a_common_prompt_equal_one_row_per_example():
    shared, plain = pair()
    examples = [(r.prompt_ids + r.response_ids, [0] * len(r.prompt_ids) + r.loss_mask)
                for r, _ in batch(5).rollouts()]
    ps = positions(shared)
    a, b = shared.sft_step(examples), plain.sft_step(examples)
    assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-5)
    assert a["sft/grad_norm"] == pytest.approx(b["sft/grad_norm"], rel=1e-4)
    assert sum(ps) < sum(len(ids) for ids, _ in examples)


def test_the_full_head_path_reads_a_laid_out_micro_batch_too():
    """Where the head cannot be split (`lm_head_not_split`: a model that never calls its
    output embedding; the trainer then stays on the full path), a micro-batch laid out with
    shared prefixes takes the full logits of the layout at the same rows."""
    shared, _ = pair()
    (mb,) = shared.plan(batching.sequences_from_batch(batch()))
    t = shared.tensors(mb)
    assert "pack_ids" in t
    model = shared.model
    got = lm_head.logprobs(model, model, t, TEMPERATURE, entropy=True, split=False)
    want = lm_head.logprobs(model, model, t, TEMPERATURE, entropy=True)
    assert want[2] and not got[2]
    read = t["mask"].bool()
    for a, b in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(a[read], b[read], atol=1e-5, rtol=1e-5)


def test_off_with_full_logits_or_another_attention():
    cfg = TorchTrainerConfig(full_logits=True)
    assert TorchTrainer(tiny_model(0), cfg, AlgorithmSection(), pad_token_id=0)._share == 0
    model = tiny_model(0)
    model.config._attn_implementation = "flash_attention_2"
    assert TorchTrainer(model, TorchTrainerConfig(), AlgorithmSection(), pad_token_id=0)._share == 0


WINDOWED = {  # tiny models whose attention has an 8-token window on some or all layers
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=16),
}


def windowed_model(kind: str, attention: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **TINY, **WINDOWED[kind])
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_sliding_window_models_train_on_their_own_log_probs(kind, attention):
    """G2: on a model with sliding-window layers, each trained token sees only its window (in
    its own sequence's positions) on those layers, as in the model's own forward of the
    sequence alone; full layers see everything. Prompts are longer than the window."""
    shared, _ = pair(windowed_model(kind, attention))
    assert shared._share
    for mb in shared.plan(batching.sequences_from_batch(batch())):
        t = shared.tensors(mb)
        assert "pack_ids" in t
        own = {k: v for k, v in t.items() if not k.startswith("pack_")}
        got = shared.logprobs(t, TEMPERATURE)
        want = lm_head.logprobs(shared.model, shared.model, own, TEMPERATURE, entropy=False)[0]
        read = t["mask"].bool()
        torch.testing.assert_close(got[read], want[read], atol=1e-5, rtol=1e-5)


def test_off_for_attention_a_mask_per_layer_type_cannot_express():
    """Chunked, bidirectional or linear/recurrent layers: sharing is off (logged), not wrong."""
    for change in ({"layer_types": ["full_attention", "linear_attention"]},
                   {"attention_chunk_size": 8}, {"use_bidirectional_attention": True}):
        model = tiny_model(0)
        for k, v in change.items():
            setattr(model.config, k, v)
        tr = TorchTrainer(model, TorchTrainerConfig(), AlgorithmSection(), pad_token_id=0)
        assert tr._share == 0, change
