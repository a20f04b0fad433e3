"""The GRPO loss: direct computation, masking, clip and dual-clip regions, micro-batch sums."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.loss import (
    StepStats,
    grpo_loss,
    kl_penalty,
    mismatch_metrics,
    sft_loss,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)

EPS_LOW, EPS_HIGH, DUAL = 0.2, 0.28, 3.0


def _loss(lp, old, adv, mask, normalizer=None):
    return grpo_loss(lp, old, adv, mask, EPS_LOW, EPS_HIGH, DUAL, normalizer=normalizer)


def _direct(lp, old, adv, mask):
    """Per-token formula written out with Python floats."""
    total, n = 0.0, 0
    for row in range(len(lp)):
        for t in range(len(lp[row])):
            if not mask[row][t]:
                continue
            r = math.exp(lp[row][t] - old[row][t])
            a = adv[row][t]
            clipped = max(-a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH))
            total += min(clipped, -a * DUAL) if a < 0 else clipped
            n += 1
    return total / n


def test_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 7, generator=g) * 3
    old = lp + (torch.rand(3, 7, generator=g) - 0.5) * 1.6   # ratios in ~[0.45, 2.2]
    adv = torch.randn(3, 1, generator=g).expand(3, 7)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    loss, m = _loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(_direct(lp.tolist(), old.tolist(), adv.tolist(),
                                                mask.tolist()), rel=1e-5)
    assert m["tokens"].item() == mask.sum().item()


def test_masked_tokens_get_zero_gradient_even_with_extreme_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -1e9, -2.9, 50.0]])   # masked positions would overflow the ratio
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss, _ = _loss(lp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 3].item() == 0.0
    assert lp.grad[0, 0].item() != 0.0 and lp.grad[0, 2].item() != 0.0


@pytest.mark.parametrize(("adv", "ratio", "loss", "has_grad", "clip", "dual"), [
    (1.0, 1.1, -1.1, True, 0, 0),                 # inside the trust region
    (1.0, 1.5, -(1 + EPS_HIGH), False, 1, 0),     # A>0 above 1+eps_high: clipped (clip-higher)
    (1.0, 1.25, -1.25, True, 0, 0),               # 1.25 < 1.28: clip-higher leaves it alone
    (1.0, 0.5, -0.5, True, 0, 0),                 # A>0 below 1-eps_low: not clipped
    (-1.0, 0.5, 1 - EPS_LOW, False, 1, 0),        # A<0 below 1-eps_low: clipped
    (-1.0, 1.2, 1.2, True, 0, 0),                 # A<0 inside
    (-1.0, 2.0, 2.0, True, 0, 0),                 # A<0 above 1+eps_high, below c: unclipped
    (-2.0, 5.0, 2.0 * DUAL, False, 0, 1),         # A<0 above c: dual-clip caps at c*|A|
    (2.0, 5.0, -2.0 * (1 + EPS_HIGH), False, 1, 0),  # dual-clip never touches A>0
])
def test_clip_and_dual_clip_regions(adv, ratio, loss, has_grad, clip, dual):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    out, m = _loss(lp, old, torch.tensor([[adv]]), torch.ones(1, 1))
    out.backward()
    assert out.item() == pytest.approx(loss, rel=1e-5)
    assert (lp.grad.abs().item() > 0) == has_grad
    if has_grad:   # d/dlogp of -A * r is -A * r
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)
    assert m["clip_frac_sum"].item() == clip
    assert m["dual_clip_frac_sum"].item() == dual
    assert m["ratio_max"].item() == pytest.approx(ratio, rel=1e-5)


def test_micro_batches_with_explicit_normalizer_sum_to_batch_token_mean():
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(4, 9, generator=g) * 2).requires_grad_()
    old = lp.detach() + (torch.rand(4, 9, generator=g) - 0.5)
    adv = torch.randn(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.4).float()
    full, _ = _loss(lp, old, adv, mask)
    (g_full,) = torch.autograd.grad(full, lp)
    n = mask.sum()
    parts = [_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], normalizer=n)[0]
             for i in (0, 2)]
    total = parts[0] + parts[1]
    (g_parts,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(g_parts, g_full)
    # without the shared normalizer each half is its own mean: not the batch token-mean
    halves = [_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2])[0] for i in (0, 2)]
    assert (halves[0] + halves[1]).item() != pytest.approx(full.item(), rel=1e-3)


def test_token_logprobs_and_entropy_are_aligned_to_the_predicted_token():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    lp = token_logprobs(logits, ids)
    ref = torch.log_softmax(logits, -1)
    assert lp[:, 0].abs().sum() == 0
    for b in range(2):
        for t in range(1, 5):
            assert lp[b, t].item() == pytest.approx(ref[b, t - 1, ids[b, t]].item(), abs=1e-5)
    hot = token_logprobs(logits, ids, temperature=0.5)
    assert hot[1, 3].item() == pytest.approx(
        torch.log_softmax(logits[1, 2] / 0.5, -1)[ids[1, 3]].item(), abs=1e-5)
    ent = token_entropy(logits, chunk=2)
    p = ref.exp()
    assert ent[0, 0] == 0
    torch.testing.assert_close(ent[:, 1:], -(p * ref).sum(-1)[:, :-1])


def test_sft_loss_is_masked_token_mean_nll():
    lp = torch.tensor([[0.0, -1.0, -2.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 0, 1]])
    loss, m = sft_loss(lp, mask)
    loss.backward()
    assert loss.item() == pytest.approx(2.5)
    assert lp.grad.tolist() == [[0.0, -0.5, 0.0, -0.5]]
    assert m["nll_sum"].item() == 5.0


@pytest.mark.parametrize("estimator, per_token, grad", [
    # d = log pi - log pi_ref per trained token; the gradient is per log pi, divided by 2 tokens
    ("k1", lambda d: d, lambda d: 1.0),
    ("k2", lambda d: d * d / 2, lambda d: d),
    ("k3", lambda d: math.exp(-d) - 1 + d, lambda d: 1 - math.exp(-d)),
])
def test_kl_penalty_estimators_their_gradients_and_the_mask(estimator, per_token, grad):
    lp = torch.tensor([[-1.0, -0.5, -2.0, -0.1]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -1e9, -0.4]])  # a masked position that would overflow
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    loss, m = kl_penalty(lp, ref, mask, estimator)
    loss.backward()
    ds = [1.0, 0.3]
    assert loss.item() == pytest.approx(sum(per_token(d) for d in ds) / 2, rel=1e-5)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, grad(1.0) / 2, 0.0,
                                                        grad(0.3) / 2]]))
    k3 = sum(math.exp(-d) - 1 + d for d in ds)  # the metric is k3 whatever trains
    assert m["kl_ref_sum"].item() == pytest.approx(k3, rel=1e-5)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, mask, "k4")


def test_mismatch_zero_when_trainer_and_sampler_agree():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    same = mismatch_metrics(lp, lp, mask)
    assert same["mismatch_abs_sum"].item() == 0 and same["mismatch_kl_sum"].item() == 0
    off = mismatch_metrics(lp, lp + torch.tensor([[0.1, -0.1, 9.0]]), mask)
    assert off["mismatch_abs_sum"].item() == pytest.approx(0.2)
    assert off["mismatch_kl_sum"].item() > 0


def test_step_stats_sums_means_and_extremes():
    s = StepStats()
    s.add({"tokens": torch.tensor(2.0), "x_sum": torch.tensor(4.0),
           "ratio_max": torch.tensor(1.5), "ratio_min": torch.tensor(0.9)})
    s.add({"tokens": torch.tensor(6.0), "x_sum": torch.tensor(4.0),
           "ratio_max": torch.tensor(1.2), "ratio_min": torch.tensor(float("inf"))})
    assert s.means("t/") == pytest.approx(
        {"t/tokens": 8.0, "t/x": 1.0, "t/ratio_max": 1.5, "t/ratio_min": 0.9})
    s.reduce()  # no process group: a no-op
    assert s.raw()["x_sum"] == 8.0


def _reference_logprobs(logits, ids, temperature=1.0):
    """The unchunked path: one float32 log-softmax over the whole `[B, T, V]` logits."""
    import torch.nn.functional as F

    b, t, v = logits.shape
    lg = logits[:, :-1].float() / temperature
    nll = F.cross_entropy(lg.reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
    return F.pad(-nll.view(b, t - 1), (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 2048])
def test_chunked_token_logprobs_equal_the_full_path_with_gradients(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 9, 50, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    w = torch.randn(3, 9, generator=g)
    got = token_logprobs(x, ids, temperature, chunk=chunk)
    (got * w).sum().backward()
    grad, x.grad = x.grad.clone(), None
    ref = _reference_logprobs(x, ids, temperature)
    (ref * w).sum().backward()
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=0)
    assert got[:, 0].eq(0).all()


def test_chunked_token_logprobs_keep_the_logits_dtype_for_the_gradient():
    x = torch.randn(2, 6, 40, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 40, (2, 6))
    lp = token_logprobs(x, ids, chunk=4)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad[:, -1].eq(0).all()
    torch.testing.assert_close(lp, _reference_logprobs(x.detach(), ids), atol=1e-5, rtol=0)


def _reference_entropy(logits, temperature=1.0):
    """The unchunked path: entropy of one float32 softmax over the whole `[B, T, V]` logits."""
    import torch.nn.functional as F

    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    return F.pad(-(logp.exp() * logp).sum(-1), (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 2048])
def test_fused_entropy_equals_the_full_path_and_leaves_the_logprob_gradient_alone(temperature,
                                                                                   chunk):
    g = torch.Generator().manual_seed(5)
    x = (3.0 * torch.randn(3, 9, 50, generator=g)).requires_grad_()  # peaked and flat rows
    ids = torch.randint(0, 50, (3, 9), generator=g)
    w = torch.randn(3, 9, generator=g)
    lp, ent = token_logprobs_and_entropy(x, ids, temperature, chunk=chunk)
    assert not ent.requires_grad  # a metric: the loss has no entropy term
    (lp * w).sum().backward()
    grad, x.grad = x.grad.clone(), None
    ref = _reference_logprobs(x, ids, temperature)
    (ref * w).sum().backward()
    torch.testing.assert_close(lp, ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, _reference_entropy(x.detach(), temperature), atol=2e-6,
                               rtol=0)
    assert ent[:, 0].eq(0).all() and ent[:, 1:].gt(0).all()
    torch.testing.assert_close(token_entropy(x.detach() / temperature, chunk=chunk), ent)


def test_fused_entropy_of_bf16_logits_and_of_a_single_position():
    x = torch.randn(2, 6, 40, dtype=torch.bfloat16)
    ids = torch.randint(0, 40, (2, 6))
    lp, ent = token_logprobs_and_entropy(x, ids, chunk=4)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(ent, _reference_entropy(x), atol=1e-5, rtol=0)
    one = torch.randn(1, 1, 40, requires_grad=True)
    lp1, ent1 = token_logprobs_and_entropy(one, torch.zeros(1, 1, dtype=torch.long))
    lp1.sum().backward()  # a dummy micro-batch still backpropagates (zeros)
    assert ent1.tolist() == [[0.0]] and one.grad.eq(0).all()
