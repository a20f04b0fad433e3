"""The LM head only at the trained positions (`asyncrl.trainer.lm_head`): the same log-probs,
entropy, metrics and gradients as logits at every position (`trainer.full_logits`), with the
head computing one row per trained token, on a full model, with LoRA and with a softcapped
head; a model whose head cannot be limited falls back or is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from grads import assert_grads_close, record_grads
from trainer_batches import VOCAB, rl_batch, tiny_model

from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, LoraSection, TorchTrainerConfig
from asyncrl.errors import TrainerError
from asyncrl.trainer import lm_head
from asyncrl.trainer.torch_trainer import TorchTrainer

TEMPERATURE = 0.7


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(model=None, budget: int = 4096, lora: LoraSection | None = None, **algo
         ) -> tuple[TorchTrainer, TorchTrainer]:
    """(split, full) trainers over copies of the same model."""
    model = model if model is not None else tiny_model(0)
    out = []
    for full in (False, True):
        cfg = TorchTrainerConfig(micro_batch_tokens=budget, full_logits=full, lora=lora)
        out.append(TorchTrainer(copy.deepcopy(model), cfg, AlgorithmSection(**{"lr": 1e-3, **algo}),
                                pad_token_id=0, temperature=TEMPERATURE))
    return out[0], out[1]


def head_rows(tr: TorchTrainer) -> list[int]:
    """Rows of logits the output embedding computes, one entry per call."""
    rows: list[int] = []
    tr.model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
    return rows


def one_micro_batch(tr: TorchTrainer, seed: int = 2) -> dict[str, torch.Tensor]:
    (mb,) = tr.plan(batching.sequences_from_batch(rl_batch(seed)))
    t = tr.tensors(mb)
    lengths = (t["input_ids"] != 0).sum(1)
    assert lengths.min() < t["input_ids"].shape[1]  # right padding in the block
    assert (t["mask"][:, :3] == 0).all()  # prompts: not trained
    return t


def test_split_logprobs_entropy_and_gradients_equal_the_full_forward():
    split, full = pair()
    t = one_micro_batch(split)
    t["mask"][1, 0] = 1.0  # a trained first token: nothing predicts it, position 0 stays 0
    got, want = split.logprobs_and_entropy(t, TEMPERATURE), \
        full.logprobs_and_entropy(t, TEMPERATURE)
    read = t["mask"].bool()
    read[:, 0] = False
    assert read.sum() > 20 and (~read).sum() > 20
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[read], w[read], atol=1e-5, rtol=1e-5)
        assert torch.equal(g[~read], torch.zeros_like(g[~read]))
    torch.testing.assert_close(split.logprobs(t, TEMPERATURE)[read], want[0][read])
    # any loss that reads the trained positions has the same gradient
    weights = torch.randn(t["mask"].shape, generator=torch.Generator().manual_seed(0))
    for lp in (got[0], want[0]):
        (lp * weights * read).sum().backward()
    fp = dict(full.model.named_parameters())
    for name, p in split.model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, fp[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_micro_batch_with_nothing_trained_computes_no_logits_and_still_backwards():
    split, _ = pair()
    rows = head_rows(split)
    t = one_micro_batch(split)
    t["mask"].zero_()
    lp, ent = split.logprobs_and_entropy(t, TEMPERATURE)
    lp.sum().backward()
    assert rows == [0] and not lp.any() and not ent.any()
    assert all(p.grad is not None for p in split.model.parameters())  # DDP needs every grad


@pytest.mark.parametrize("minis", [1, 2])
def test_rl_steps_equal_the_full_logits_steps(minis):
    """Old log-probs (fused and separate), the KL reference, the TIS correction, mismatch,
    ratio quantiles and entropy: every metric and every gradient as with full logits."""
    split, full = pair(budget=96, optimizer_steps_per_rl_step=minis, kl_coef=0.05,
                       correction="tis")
    gs, gf = record_grads(split), record_grads(full)
    batch = rl_batch(2)
    for _ in range(2):
        ms, mf = split.train_step(batch), full.train_step(batch)
    assert ms["train/micro_batches"] > minis and len(gs) == len(gf) == 2 * minis
    assert ms.keys() == mf.keys() and "train/kl_ref" in ms and "train/mismatch_ratio_p50" in ms
    for k, v in mf.items():
        assert ms[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert all(a.keys() == b.keys() for a, b in zip(gs, gf, strict=True))
    assert_grads_close(gs, gf)


def test_the_lm_head_computes_one_row_per_trained_token_not_every_position():
    split, full = pair(budget=96)
    rows_s, rows_f = head_rows(split), head_rows(full)
    seqs = batching.sequences_from_batch(rl_batch(2))
    ms, mf = split.train_step(rl_batch(2)), full.train_step(rl_batch(2))
    padded = sum(t["input_ids"].numel() for t in map(split.tensors, split.plan(seqs)))
    assert len(rows_s) == len(rows_f) == ms["train/micro_batches"]  # one forward each
    assert sum(rows_s) == ms["train/tokens"] == mf["train/tokens"]
    assert sum(rows_f) == padded > sum(rows_s)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_steps_equal_the_full_logits_steps(targets):
    """The adapter's gradients are the same, a LoRA layer as the output embedding included."""
    pytest.importorskip("peft")
    split, full = pair(budget=96, lora=LoraSection(rank=4, alpha=8, target_modules=targets))
    assert split.lora_active
    head = split.model.get_output_embeddings()
    assert ("lm_head" in targets) == hasattr(head, "lora_A")
    rows = head_rows(split)
    gs, gf = record_grads(split), record_grads(full)
    for _ in range(2):  # the second step's B is no longer zero
        ms, mf = split.train_step(rl_batch(1)), full.train_step(rl_batch(1))
    assert sum(rows) == 2 * ms["train/tokens"]
    assert ms["train/loss"] == pytest.approx(mf["train/loss"], rel=1e-4, abs=1e-6)
    assert ms["train/entropy"] == pytest.approx(mf["train/entropy"], rel=1e-5)
    for a, b in zip(gs, gf, strict=True):
        assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    assert_grads_close(gs, gf)


def test_a_softcapped_head_splits_exactly():
    """Gemma 2 caps its logits after the head, position by position: the cap applies to the
    chosen rows as it did to all of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
                               final_logit_softcapping=2.0, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    split, full = pair(model)
    t = one_micro_batch(split)
    got, want = split.logprobs_and_entropy(t, TEMPERATURE), \
        full.logprobs_and_entropy(t, TEMPERATURE)
    read = t["mask"].bool()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[read], w[read], atol=1e-5, rtol=1e-5)
    # the cap is in force: no tempered logit exceeds 2 / T, so no log-prob is below -4 / T - log V
    assert want[0][read].min() > -4.0 / TEMPERATURE - torch.log(torch.tensor(VOCAB)) - 1e-4


class _HeadByHand(torch.nn.Module):
    """A causal LM that computes its logits from the embedding weight without calling its
    output embedding (`twice`: calls it twice instead)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB, bias=False)
        self.twice = twice

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids, position_ids=None, use_cache=False):
        h = self.embed(input_ids).cumsum(1)
        if self.twice:
            self.head(h)
            logits = self.head(h)
        else:
            logits = torch.nn.functional.linear(h, self.embed.weight)
        return type("Out", (), {"logits": logits})()


def test_a_head_called_by_hand_falls_back_and_one_called_twice_is_refused():
    t = {"input_ids": torch.tensor([[3, 4, 5, 6]]), "position_ids": torch.arange(4)[None],
         "mask": torch.tensor([[0.0, 0.0, 1.0, 1.0]])}
    model = _HeadByHand()
    lp, _, split = lm_head.logprobs(model, model, t, 1.0, entropy=False)
    want, _, _ = lm_head.logprobs(model, model, t, 1.0, entropy=False, split=False)
    assert not split and torch.equal(lp, want) and lp[0, 1] != 0  # full logits, every position
    twice = _HeadByHand(twice=True)
    with pytest.raises(TrainerError, match="full_logits"):
        lm_head.logprobs(twice, twice, t, 1.0, entropy=False)
