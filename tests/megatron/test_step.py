"""The shared RL and SFT steps (`asyncrl.algo.step`) through each trainer that lends them a
backend: the same metrics, a step that moves the weights, tool output that is never trained
on, and one set of numbers for both trainers.

Here rather than in `tests/algo` because the megatron trainer needs this directory's
`cpu_megatron` fixture and `mg_cases` models; the torch cases run without megatron-core.
"""

from __future__ import annotations

import copy

import pytest
import torch
from mg_cases import VOCAB, hf_model, rl_batch, sft_examples

from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig
from asyncrl.records import Batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                                        "ignore::DeprecationWarning:megatron")

BUDGET = 64  # several micro-batches per mini-batch

# What `train_step` reports under the default `algorithm.correction = "none"` (a user's
# dashboards and `train.py`'s logging read these names).
RL_KEYS = {
    "train/loss", "train/pg_loss", "train/approx_kl", "train/clip_frac", "train/dual_clip_frac",
    "train/ratio", "train/ratio_max", "train/ratio_min", "train/entropy", "train/tokens",
    "train/mismatch_abs", "train/mismatch_kl", "train/mismatch_ratio_max",
    "train/mismatch_ratio_min", "train/mismatch_ratio_p01", "train/mismatch_ratio_p05",
    "train/mismatch_ratio_p50", "train/mismatch_ratio_p95", "train/mismatch_ratio_p99",
    "train/stale_kl", "train/stale_token_frac", "train/version_lag_max", "train/corr_coef",
    "train/corr_masked_frac", "train/corr_truncated_frac",
    "train/grad_norm", "train/grad_norm_max", "train/lr", "train/sequences",
    "train/mini_batches", "train/micro_batches", "train/optimizer_step",
}
SFT_KEYS = {"sft/loss", "sft/tokens", "sft/grad_norm", "sft/lr", "sft/examples",
            "sft/optimizer_step"}


def build(kind: str, hf, **algo):
    opts = {"lr": 1e-3, "optimizer_steps_per_rl_step": 2, **algo}
    if kind == "torch":
        from asyncrl.trainer.torch_trainer import TorchTrainer

        return TorchTrainer(copy.deepcopy(hf), TorchTrainerConfig(micro_batch_tokens=BUDGET),
                            AlgorithmSection(**opts), pad_token_id=0, temperature=0.8)
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(copy.deepcopy(hf),
                           MegatronTrainerConfig(micro_batch_tokens=BUDGET, recompute="none"),
                           AlgorithmSection(**opts), pad_token_id=0, temperature=0.8)


@pytest.fixture(params=["torch", "megatron"])
def kind(request):
    """Each trainer kind; megatron-core patched for the CPU only for the megatron case."""
    if request.param == "megatron":
        request.getfixturevalue("cpu_megatron")
        yield request.param
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield request.param
    torch.set_num_threads(threads)


def weights(tr) -> dict[str, torch.Tensor]:
    """Full weights by HF name, copied (the torch trainer's are views of live parameters)."""
    return {k: v.detach().clone() for k, v in tr.state_dict_for_sync().items()}


def with_tool_tail(batch: Batch, tail: list[int], change_last_trained: bool = False) -> Batch:
    """`batch` with the tokens `tail` appended to every response as tool output (mask 0),
    so they close the sequence and no trained token comes after them. With
    `change_last_trained`, the last trained token of every response is replaced as well."""
    for g in batch.groups:
        for r in g.rollouts:
            if change_last_trained:
                r.response_ids[-1] = (r.response_ids[-1] + 1) % VOCAB or 2
            r.response_ids += tail
            r.loss_mask += [0] * len(tail)
            r.logprobs += [0.0] * len(tail)
    return batch


def test_rl_step_reports_every_metric_and_moves_every_weight(kind):
    tr = build(kind, hf_model("qwen3"))
    batch = rl_batch(0)
    before = weights(tr)
    m = tr.train_step(batch)

    assert set(m) == RL_KEYS
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    seqs = batching.sequences_from_batch(rl_batch(0))
    assert m["train/tokens"] == sum(s.num_loss_tokens for s in seqs)
    assert m["train/sequences"] == len(seqs)
    assert m["train/mini_batches"] == 2 == m["train/optimizer_step"] == tr.optimizer_step
    assert m["train/micro_batches"] > 2  # the budget split each mini-batch
    assert m["train/loss"] == m["train/pg_loss"]
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0  # 2nd mini-batch moved
    assert m["train/grad_norm"] > 0 and m["train/entropy"] > 0
    after = weights(tr)
    for k, w in before.items():
        assert (after[k] - w).abs().max() > 1e-4, k


def test_sft_step_reports_its_metrics_and_eval_is_its_loss_without_an_update(kind):
    tr = build(kind, hf_model("qwen2"))
    before = weights(tr)
    held_out = tr.sft_eval(sft_examples())
    assert set(held_out) == {"sft/loss", "sft/tokens"}
    assert all(torch.equal(v, before[k]) for k, v in weights(tr).items())  # eval: no update

    m = tr.sft_step(sft_examples())
    assert set(m) == SFT_KEYS
    assert m["sft/loss"] == pytest.approx(held_out["sft/loss"], rel=1e-5)
    assert m["sft/tokens"] == held_out["sft/tokens"] == sum(
        sum(mask) for _, mask in sft_examples())
    assert m["sft/optimizer_step"] == 1 and m["sft/grad_norm"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in weights(tr).items())
    assert tr.sft_eval(sft_examples())["sft/loss"] < held_out["sft/loss"]


def test_tool_output_gets_no_gradient(kind):
    """Tool output closing every response (mask 0) is not trained on, by the RL step or the
    SFT step: replacing it leaves the update and every metric unchanged, while replacing a
    trained token does not."""
    hf = hf_model("qwen3")

    def rl(batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        tr = build(kind, hf, optimizer_steps_per_rl_step=1)
        return tr.train_step(batch), weights(tr)

    def sft(tail: list[int], change_last_trained: bool = False
            ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        examples = []
        for ids, mask in sft_examples():
            if change_last_trained:
                ids = [*ids[:-1], (ids[-1] + 1) % VOCAB or 2]
            examples.append(([*ids, *tail], [*mask, *[0] * len(tail)]))
        tr = build(kind, hf)
        return tr.sft_step(examples), weights(tr)

    runs = {
        "rl": (rl(with_tool_tail(rl_batch(0), [5, 6, 7])),
               rl(with_tool_tail(rl_batch(0), [200, 201, 202])),
               rl(with_tool_tail(rl_batch(0), [5, 6, 7], change_last_trained=True))),
        "sft": (sft([5, 6, 7]), sft([200, 201, 202]), sft([5, 6, 7], change_last_trained=True)),
    }
    for step, ((ref_m, ref_w), (tool_m, tool_w), (trained_m, trained_w)) in runs.items():
        assert tool_m == pytest.approx(ref_m, rel=1e-6, abs=1e-9), step
        for k, w in ref_w.items():
            torch.testing.assert_close(tool_w[k], w, atol=1e-7, rtol=0, msg=f"{step} {k}")
        # the control: a trained token is seen by the loss
        norm = f"{step.replace('rl', 'train')}/grad_norm"
        assert trained_m[norm] != pytest.approx(ref_m[norm], rel=1e-4), step
        assert any((trained_w[k] - w).abs().max() > 1e-4 for k, w in ref_w.items()), step


def test_both_trainers_report_the_same_numbers_with_a_correction_and_an_lr_scale(cpu_megatron):
    """The same tiny model and batch give the same RL and SFT metrics under either trainer,
    with the correction's metrics and a scaled lr on the way (`test_trainer.py` compares the
    default path's gradients)."""
    hf = hf_model("qwen3")
    runs = []
    for k in ("torch", "megatron"):
        tr = build(k, hf, correction="tis")
        runs.append([tr.train_step(rl_batch(1), lr_scale=0.5), tr.sft_step(sft_examples()),
                     tr.sft_eval(sft_examples())])
    (rl_t, sft_t, ev_t), (rl_m, sft_m, ev_m) = runs
    assert rl_t.keys() == RL_KEYS
    assert rl_t["train/lr"] == pytest.approx(0.5e-3)
    for mine, ref in ((rl_m, rl_t), (sft_m, sft_t), (ev_m, ev_t)):
        assert mine.keys() == ref.keys()
        for key in ref:
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


def test_kl_to_the_reference_starts_at_zero_pulls_back_and_survives_a_restore(kind, tmp_path):
    """`algorithm.kl_coef`: the reference is the policy at the first update (KL 0 there); once
    the policy has moved, steps whose advantages are all zero (no policy-gradient signal)
    walk it back towards the reference, where a negligible weight lets it drift on; a trainer
    restored from a checkpoint keeps the same reference (its next step is the same)."""
    hf = hf_model("qwen3")

    def no_signal(batch: Batch) -> Batch:
        for g in batch.groups:
            g.advantages = [0.0] * len(g.advantages)
        return batch

    runs = {}
    for coef in (1.0, 1e-9):
        tr = build(kind, hf, kl_coef=coef, optimizer_steps_per_rl_step=1)
        first = tr.train_step(rl_batch(0))
        assert set(first) == RL_KEYS | {"train/kl_ref"}
        assert first["train/kl_ref"] == 0.0
        for i in range(1, 4):
            tr.train_step(rl_batch(i))
        runs[coef] = (tr, [tr.train_step(no_signal(rl_batch(0)))["train/kl_ref"]
                           for _ in range(8)])
    strong, kl_strong = runs[1.0]
    kl_weak = runs[1e-9][1]
    assert kl_strong[0] > 0.0 and kl_weak[0] > 0.0
    assert kl_strong[-1] < 0.5 * kl_strong[0]  # pulled back
    assert kl_weak[-1] > kl_weak[0]  # Adam's momentum carries it further away

    strong.save_state(tmp_path)
    restored = build(kind, hf, kl_coef=1.0, optimizer_steps_per_rl_step=1)
    restored.load_state(tmp_path)
    going_on, again = strong.train_step(rl_batch(4)), restored.train_step(rl_batch(4))
    assert going_on["train/kl_ref"] > 0.0
    for key in going_on:
        assert again[key] == pytest.approx(going_on[key], rel=1e-5, abs=1e-7), key


def test_both_trainers_report_the_same_kl_penalty(cpu_megatron):
    hf = hf_model("qwen3")
    runs = []
    for k in ("torch", "megatron"):
        tr = build(k, hf, kl_coef=0.5, kl_estimator="k2")
        runs.append([tr.train_step(rl_batch(1)), tr.train_step(rl_batch(2))])
    for mine, ref in zip(runs[1], runs[0], strict=True):
        assert mine.keys() == ref.keys() == RL_KEYS | {"train/kl_ref"}
        for key in ref:
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    assert runs[0][1]["train/kl_ref"] > 0.0
