"""Off-policy corrections and mismatch metrics against hand-computed cases.

The fixture: three trained tokens with pi_prox = (0.5, 0.25, 0.1) and mu = (0.25, 0.5, 0.1),
so the behaviour weights w = pi_prox / mu are exactly (2, 0.5, 1); a fourth token is masked
and carries a huge weight that must never show up anywhere."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.loss import StepStats, grpo_loss
from asyncrl.algo.offpolicy import (
    RatioQuantiles,
    correction_coef,
    correction_for,
    mismatch_stats,
    quantiles,
)
from asyncrl.config import AlgorithmSection

PROX = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.9]]))
BEHAV = torch.log(torch.tensor([[0.25, 0.5, 0.1, 1e-6]]))
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
LAG = torch.tensor([[0, 2, 1, 7]])


def _coef(kind: str, **kw):
    coef, m = correction_coef(kind, PROX, BEHAV, MASK, **kw)
    return [round(x, 6) for x in coef[0].tolist()], {k: float(v) for k, v in m.items()}


def test_none_is_one_on_trained_tokens():
    coef, m = _coef("none")
    assert coef == [1.0, 1.0, 1.0, 0.0]
    assert m["corr_masked_frac_sum"] == 0.0


def test_tis_truncates_the_weight_at_its_cap():
    coef, m = _coef("tis", tis_cap=1.5)
    assert coef == [1.5, 0.5, 1.0, 0.0]
    assert m["corr_truncated_frac_sum"] == 1.0 and m["corr_masked_frac_sum"] == 0.0


def test_icepop_masks_tokens_whose_weight_leaves_the_band():
    coef, m = _coef("icepop", icepop_low=0.6, icepop_high=1.8)
    assert coef == [0.0, 0.0, 1.0, 0.0]
    assert m["corr_masked_frac_sum"] == 2.0
    coef, _ = _coef("icepop", icepop_low=0.5, icepop_high=2.0)  # bounds are inclusive
    assert coef == [1.0, 1.0, 1.0, 0.0]


def test_decoupled_weights_by_pi_prox_over_mu_and_masks_above_its_cap():
    coef, _ = _coef("decoupled")
    assert coef == [2.0, 0.5, 1.0, 0.0]
    coef, m = _coef("decoupled", decoupled_cap=1.5)
    assert coef == [0.0, 0.5, 1.0, 0.0]
    assert m["corr_masked_frac_sum"] == 1.0


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        correction_coef("vtrace", PROX, BEHAV, MASK)


def test_coef_multiplies_each_tokens_loss_and_gradient():
    # ratio pi_theta / pi_prox = 1 and A = 1: each token's clipped loss is -1, so the loss is
    # -(sum of coefficients) / 3 and d loss / d logp_t = -coef_t / 3.
    lp = PROX.clone().requires_grad_(True)
    adv = torch.ones_like(lp)
    coef, _ = correction_coef("decoupled", PROX, BEHAV, MASK)
    loss, m = grpo_loss(lp, PROX, adv, MASK, 0.2, 0.28, 3.0, coef=coef)
    assert loss.item() == pytest.approx(-(2 + 0.5 + 1) / 3)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([-2 / 3, -0.5 / 3, -1 / 3, 0.0])
    assert m["tokens"].item() == 3.0  # masked-by-correction tokens still count in the mean
    plain, _ = grpo_loss(PROX, PROX, adv, MASK, 0.2, 0.28, 3.0)
    assert plain.item() == pytest.approx(-1.0)


def test_mismatch_stats_by_hand():
    m = {k: float(v) for k, v in mismatch_stats(PROX, BEHAV, MASK, LAG).items()}
    ln2 = math.log(2)
    # k3 = w - 1 - log w: (1 - ln2) + (-0.5 + ln2) + 0 = 0.5
    assert m["mismatch_kl_sum"] == pytest.approx(0.5, abs=1e-6)
    assert m["mismatch_abs_sum"] == pytest.approx(2 * ln2, abs=1e-6)
    assert m["stale_token_frac_sum"] == 2.0           # lags 2 and 1; the masked 7 is ignored
    assert m["stale_kl_sum"] == pytest.approx(ln2 - 0.5, abs=1e-6)
    assert m["version_lag_max"] == 2.0
    assert m["mismatch_ratio_max"] == pytest.approx(2.0)
    assert m["mismatch_ratio_min"] == pytest.approx(0.5)
    stats = StepStats()
    stats.add({"tokens": MASK.sum()})
    stats.add(mismatch_stats(PROX, BEHAV, MASK, LAG))
    means = stats.means("train/")
    assert means["train/stale_token_frac"] == pytest.approx(2 / 3)
    assert means["train/mismatch_kl"] == pytest.approx(0.5 / 3, abs=1e-6)


def test_on_policy_tokens_have_zero_mismatch():
    m = mismatch_stats(PROX, PROX, MASK)
    assert float(m["mismatch_kl_sum"]) == 0.0 and float(m["stale_token_frac_sum"]) == 0.0


def test_ratio_quantiles_over_micro_batches():
    q = RatioQuantiles()
    assert q.metrics() == {}
    q.add(PROX, BEHAV, MASK)          # w = 2, 0.5, 1
    q.add(PROX[:, :1], PROX[:, :1], MASK[:, :1])  # w = 1
    out = q.metrics("train/")
    assert out["train/mismatch_ratio_p50"] == pytest.approx(1.0)
    assert out["train/mismatch_ratio_p01"] == pytest.approx(0.5, rel=0.05)
    assert out["train/mismatch_ratio_p99"] == pytest.approx(2.0, rel=0.05)


def test_quantiles_match_torch_and_work_past_its_2_to_the_24_limit():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    qs = RatioQuantiles.QUANTILES
    assert torch.allclose(quantiles(x, qs), torch.quantile(x, torch.tensor(qs)))
    big = torch.arange(2**24 + 2, dtype=torch.float64)  # torch.quantile raises on this
    with pytest.raises(RuntimeError):
        torch.quantile(big, torch.tensor(qs))
    assert quantiles(big, (0.0, 0.5, 1.0)).tolist() == [0.0, (2**24 + 1) / 2, 2**24 + 1]


def test_correction_for_reads_the_algorithm_section():
    algo = AlgorithmSection(correction="tis", tis_cap=1.5)
    coef, _ = correction_for(algo, PROX, BEHAV, MASK)
    assert coef[0].tolist() == pytest.approx([1.5, 0.5, 1.0, 0.0])
    assert correction_for(AlgorithmSection(), PROX, BEHAV, MASK)[0][0].tolist() == [1, 1, 1, 0]
