"""Batched sampling (`engine.sampling`): greedy exact, distributions, seeds, log-probs."""

from __future__ import annotations

import torch

from asyncrl.algo.loss import token_logprobs
from asyncrl.engine.local.sampling import sample_rows

V = 40


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_are_argmax_with_unscaled_logprob() -> None:
    x = _logits()
    toks, lps = sample_rows(x, [0.0] * 4, [1.0] * 4, [None] * 4, _gen())
    assert toks == x.argmax(dim=-1).tolist()
    ref = torch.log_softmax(x, dim=-1).max(dim=-1).values
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float32), ref)


def test_mixed_batch_greedy_rows_unaffected_by_sampled_neighbours() -> None:
    x = _logits(6)
    toks, _ = sample_rows(x, [0.0, 1.0, 0.0, 0.7, 1.3, 0.0], [1.0, 1.0, 1.0, 0.5, 1.0, 1.0],
                          [None] * 6, _gen())
    assert [toks[i] for i in (0, 2, 5)] == [int(x[i].argmax()) for i in (0, 2, 5)]


def _empirical(toks: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(toks), minlength=V).double() / len(toks)


def _per_row_reference(row: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The old engine's per-row rule: softmax at the temperature, nucleus by sorted mass."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    sp, si = probs.sort(descending=True)
    sp[(sp.cumsum(0) - sp) >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, si, sp / sp.sum())


def test_sampled_rows_follow_the_per_row_distribution() -> None:
    x = _logits(3, seed=1)
    n = 30_000
    for row, (t, p) in enumerate([(1.0, 1.0), (0.6, 1.0), (1.2, 0.7)]):
        toks, _ = sample_rows(x[row:row + 1].repeat(n, 1), [t] * n, [p] * n, [None] * n,
                              _gen(row))
        emp, ref = _empirical(toks), _per_row_reference(x[row], t, p)
        assert (emp - ref).abs().max() < 0.015, (t, p)
        assert emp[ref == 0].sum() == 0  # never outside the nucleus


def test_logprobs_are_temperature_scaled_and_match_the_trainers() -> None:
    x = _logits(8, seed=2)
    temps = [1.0, 0.5, 1.5, 1.0, 0.8, 1.0, 2.0, 1.0]
    toks, lps = sample_rows(x, temps, [1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.3], [None] * 8, _gen())
    # the trainer's contract: logits at position t score the token at t + 1
    ref = torch.stack([token_logprobs(torch.stack([x[i], x[i]]).unsqueeze(0),
                                      torch.tensor([[0, toks[i]]]), temperature=temps[i])[0, 1]
                       for i in range(8)])
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float32), ref, atol=1e-5, rtol=0)


def test_a_seeded_row_does_not_depend_on_its_neighbours() -> None:
    x = _logits(5, seed=3)
    alone, _ = sample_rows(x[2:3], [1.0], [1.0], [_gen(7)], _gen(0))
    mixed, _ = sample_rows(x, [1.0, 0.0, 1.0, 0.5, 1.0], [1.0] * 5,
                           [None, None, _gen(7), _gen(9), None], _gen(123))
    assert mixed[2] == alone[0]
    # the same seed repeats its sequence; another seed gives another one
    draws = [[sample_rows(x[2:3], [1.0], [1.0], [g], _gen())[0][0] for _ in range(30)]
             for g in (_gen(7), _gen(7), _gen(8))]
    assert draws[0][0] == alone[0] and draws[0] == draws[1] != draws[2]


def test_masked_tokens_are_never_sampled() -> None:
    x = _logits(2, seed=4)
    x[:, :30] = float("-inf")
    n = 5000
    toks, lps = sample_rows(x[:1].repeat(n, 1), [1.0] * n, [1.0] * n, [None] * n, _gen())
    assert min(toks) >= 30 and all(lp > -1e29 for lp in lps)


def test_two_level_pick_is_the_one_level_inverse_cdf() -> None:
    """The block-then-entry search returns the token a running sum over the whole vocabulary
    would, for the same uniforms (V not a multiple of the block size, masked runs that cover
    whole blocks and cross block edges)."""
    from asyncrl.engine.local import sampling

    v, n = 1_003, 20_000
    row = torch.randn(v, generator=_gen(5)) * 3.0
    row[100:260] = float("-inf")  # whole blocks of 31 and both partial edges
    row[-7:] = float("-inf")  # the short last block
    x = row.repeat(n, 1)
    u = torch.rand(n, generator=_gen(6))
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    size = 31
    blocked = sampling._pick_blocked(e, sampling._block_sums(e, size).cumsum(dim=-1), size, u)
    flat = sampling._pick(e.double().cumsum(dim=-1), u.double())
    assert bool(torch.isfinite(row[blocked]).all())
    assert (blocked != flat).float().mean() < 1e-3  # only rounding at a token's edge may differ


def test_uniform_at_the_top_never_picks_a_masked_token() -> None:
    from asyncrl.engine.local import sampling

    e = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]]).repeat(3, 1)
    u = torch.tensor([0.0, 0.999999, 1.0])  # 1.0 is outside rand's range: the rounding case
    got = sampling._pick_blocked(e, sampling._block_sums(e, 2).cumsum(dim=-1), 2, u)
    assert got.tolist() == [0, 1, 1]
