"""RoC: penalties, the 2G -> G counting rule, positive rules, and apply_roc on groups."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import roc
from asyncrl.config import RocSection
from asyncrl.errors import ConfigError
from asyncrl.records import Group, Problem, Rollout, RolloutStatus, ToolCall, ToolStatus, Turn

GOOD = "<reason>r</reason><answer>\\boxed{1}</answer>"


def rollout(i: int, reward: float, statuses: tuple[str, ...] = ("ok",), text: str = GOOD,
            assistant_turns: int = 1) -> Rollout:
    turns = [Turn(role="assistant", start=0, end=0) for _ in range(assistant_turns)]
    return Rollout(
        rollout_id=f"r{i}", prompt_id="p", group_id="g", policy_version=0, prompt_ids=[1],
        tool_calls=[ToolCall(name="python", status=ToolStatus(s)) for s in statuses],
        response_text=text, reward=reward, turns=turns)


def group(rollouts: list[Rollout], gid: str = "g") -> Group:
    return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="1"),
                 rollouts=rollouts)


def signs(num_pos: int, num_neg: int, seed: int = 0) -> Group:
    """A group with num_pos positives and num_neg negatives in shuffled order."""
    rewards = [1.0] * num_pos + [0.0] * num_neg
    random.Random(seed).shuffle(rewards)
    return group([rollout(i, r) for i, r in enumerate(rewards)])


# ------------------------------------------------------------------------------ penalties
def test_p_err_counts_every_non_ok_status_as_failed():
    r = rollout(0, 1.0, ("ok", "error", "timeout", "sandbox_failure", "malformed", "ok",
                         "killed", "ok"))
    assert roc.p_err(r, 0.5) == pytest.approx(5 / 8)
    assert roc.p_err(rollout(0, 1.0, ("ok", "ok")), 0.5) == 0.0


def test_p_err_without_tool_call_is_configured_value():
    assert roc.p_err(rollout(0, 1.0, ()), 0.5) == 0.5
    assert roc.p_err(rollout(0, 1.0, ()), 0.2) == 0.2


@pytest.mark.parametrize(("text", "turns", "expected"), [
    (GOOD, 1, 0.0),
    ("no markup at all \\boxed{1}", 1, 1.0),                                # missing block
    ("<answer>\\boxed{1}", 1, 1.0),                                          # unclosed
    ("<answer>\\boxed{1}</answer></answer>", 1, 1.0),                        # unbalanced
    ("<answer>42</answer>", 1, 1.0),                                         # no \boxed
    ("<answer>\\boxed{1}</answer> <answer>\\boxed{1}</answer>", 2, 0.5),     # one repeat / 2 turns
    ("<answer>\\boxed{1}</answer>" * 3, 4, 0.5),                             # two repeats / 4 turns
    ("<answer>\\boxed{1}</answer>" * 3, 1, 1.0),                             # capped at 1
])
def test_p_format(text, turns, expected):
    assert roc.p_format(rollout(0, 1.0, text=text, assistant_turns=turns)) == expected


# ------------------------------------------------------------------------ counting rule
@pytest.mark.parametrize(("pos", "neg", "g", "expected"), [
    (12, 4, 8, (6, 2)),    # ratio 3:1 kept exactly
    (6, 2, 4, (2, 2)),     # 3:1 would give 3:1, negative floor 2 lifts negatives
    (15, 1, 8, (7, 1)),    # rounds to 8:0; the single negative is kept (floor capped at 1)
    (1, 15, 8, (1, 7)),    # 0.5 rounds half up to one positive
    (2, 14, 8, (2, 6)),    # ratio gives 1 positive; floor 2 lifts it
    (16, 0, 8, (8, 0)),    # all correct
    (0, 16, 8, (0, 8)),    # all wrong
    (5, 5, 8, (4, 4)),     # fewer than 2G but more than G: same rule
    (3, 3, 8, (3, 3)),     # fewer than G: keep all
])
def test_split_counts_hand_worked(pos, neg, g, expected):
    assert roc.split_counts(pos, neg, g, min_pos=2, min_neg=2) == expected


def test_floors_larger_than_group_size_are_a_config_error():
    with pytest.raises(ConfigError, match=r"roc\.min_pos"):
        roc.split_counts(8, 8, 3, min_pos=2, min_neg=2)
    with pytest.raises(ConfigError):
        roc.check_config(RocSection(min_pos=3, min_neg=2), group_size=4)


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 40), neg=st.integers(0, 40), g=st.integers(1, 24),
       min_pos=st.integers(0, 6), min_neg=st.integers(0, 6))
def test_split_counts_properties(pos, neg, g, min_pos, min_neg):
    if min_pos + min_neg > g:
        return
    n = pos + neg
    k_pos, k_neg = roc.split_counts(pos, neg, g, min_pos, min_neg)
    assert 0 <= k_pos <= pos and 0 <= k_neg <= neg
    assert k_pos + k_neg == min(g, n)
    if n > g:
        assert k_pos >= min(min_pos, pos) and k_neg >= min(min_neg, neg)
        ideal = pos * g / n
        floors_bind = round(ideal + 1e-9) < min(min_pos, pos) or \
            g - round(ideal + 1e-9) < min(min_neg, neg)
        if not floors_bind:
            assert abs(k_pos - ideal) <= 0.5 + 1e-9


# ---------------------------------------------------------------------------- selection
@settings(max_examples=150, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=0, max_size=32),
       penalties=st.lists(st.integers(0, 4), min_size=32, max_size=32),
       g=st.integers(4, 16), seed=st.integers(0, 2**32), rule=st.sampled_from(["weighted", "lowest"]))
def test_select_properties(rewards, penalties, g, seed, rule):
    statuses = [("ok",) * (4 - p) + ("error",) * p for p in penalties]
    grp = group([rollout(i, r, statuses[i]) for i, r in enumerate(rewards)])
    cfg = RocSection(positive=rule)
    a = roc.select(grp, cfg, g, random.Random(seed))
    b = roc.select(grp, cfg, g, random.Random(seed))
    assert a.kept == b.kept                                   # deterministic for a seed
    assert len(a.kept) == min(g, len(rewards))                # output size G
    assert a.kept == sorted(set(a.kept)) and all(0 <= i < len(rewards) for i in a.kept)
    pos, neg = sum(r > 0 for r in rewards), sum(r <= 0 for r in rewards)
    assert (a.kept_pos, a.kept_neg) == roc.split_counts(pos, neg, g, 2, 2)
    assert grp.kept == []                                     # select is pure


def test_lowest_rule_keeps_the_lowest_penalties():
    # 6 positives with 0..5 failed calls out of 5, 10 negatives; G=8 -> round(6*8/16)=3 pos.
    rs = [rollout(i, 1.0, ("ok",) * (5 - i) + ("error",) * i) for i in range(6)]
    rs += [rollout(6 + i, 0.0) for i in range(10)]
    random.Random(1).shuffle(rs)
    out = roc.select(group(rs), RocSection(positive="lowest"), 8, random.Random(0))
    kept_pos_ids = sorted(rs[i].rollout_id for i in out.kept if rs[i].reward > 0)
    assert kept_pos_ids == ["r0", "r1", "r2"]
    assert out.kept_neg == 5


def test_weighted_rule_matches_documented_probabilities():
    # Three positives with p_total 0.0, 0.5 (no tool call) and 1.0 + 0.5 (all calls failed +
    # one repeated block / two turns), thirteen negatives; G=2 of 16 -> round(3*2/16) = 0
    # positives, floor min_pos=1 lifts it to exactly one draw.
    twice = "<answer>\\boxed{1}</answer><answer>\\boxed{1}</answer>"
    pos = [rollout(0, 1.0, ("ok",)), rollout(1, 1.0, ()),
           rollout(2, 1.0, ("error",), text=twice, assistant_turns=2)]
    grp = group(pos + [rollout(3 + i, 0.0) for i in range(13)])
    cfg = RocSection(positive="weighted", min_pos=1, min_neg=1)
    p_total = roc.select(grp, cfg, 2, random.Random(0)).p_total[:3]
    assert p_total == [0.0, 0.5, 1.5]
    w = [1 / (p + 0.1) for p in p_total]           # the documented rule, floor 0.1
    expected = [x / sum(w) for x in w]
    trials = 4000
    counts = Counter()
    for seed in range(trials):
        out = roc.select(grp, cfg, 2, random.Random(seed))
        (chosen,) = [i for i in out.kept if i < 3]
        counts[chosen] += 1
    for i in range(3):
        # binomial std <= 0.008 at 4000 trials; 4 sigma
        assert abs(counts[i] / trials - expected[i]) < 0.032, (counts, expected)


def test_weighted_rule_prefers_low_penalty_without_excluding_high():
    # 8 clean and 8 noisy positives, 16 negatives; G=16 keeps 8 positives.
    rs = [rollout(i, 1.0, ("ok",)) for i in range(8)]
    rs += [rollout(8 + i, 1.0, ("error", "error")) for i in range(8)]
    rs += [rollout(16 + i, 0.0) for i in range(16)]
    grp = group(rs)
    clean = noisy = 0
    for seed in range(300):
        kept = roc.select(grp, RocSection(positive="weighted"), 16, random.Random(seed)).kept
        clean += sum(i < 8 for i in kept)
        noisy += sum(8 <= i < 16 for i in kept)
    assert clean + noisy == 300 * 8
    assert clean > 3 * noisy          # weights 10 vs 0.91: clean ones dominate
    assert noisy > 0                  # sampling, not a hard filter


def test_negatives_are_sampled_uniformly():
    rs = [rollout(i, 1.0) for i in range(4)] + [rollout(4 + i, 0.0) for i in range(12)]
    counts = Counter()
    for seed in range(600):
        kept = roc.select(group(rs), RocSection(), 8, random.Random(seed)).kept
        counts.update(i for i in kept if i >= 4)
    # each negative kept with probability 6/12; 600 trials -> mean 300, std ~12
    assert all(abs(counts[i] - 300) < 60 for i in range(4, 16)), counts


@pytest.mark.parametrize("kind", ["roc", "grpo_first", "grpo_all"])
def test_aborted_and_failed_rollouts_are_never_kept(kind):
    rs = [rollout(i, float(i % 2)) for i in range(16)]
    for i in (0, 3, 5, 8):
        rs[i].status = RolloutStatus.FAILED if i % 2 else RolloutStatus.ABORTED
    grp = group(rs)
    out = roc.select(grp, RocSection(kind=kind), 8, random.Random(0))
    assert not {0, 3, 5, 8} & set(out.kept)
    assert len(out.kept) == (12 if kind == "grpo_all" else 8)
    if kind == "grpo_first":
        assert out.kept == [1, 2, 4, 6, 7, 9, 10, 11]
    _, m = roc.apply_roc([grp], RocSection(kind=kind), 8, rng=0)
    assert m["roc/rollouts_unusable"] == 4


def test_grpo_ablations_keep_first_or_all():
    grp = signs(9, 7)
    first = roc.select(grp, RocSection(kind="grpo_first"), 8, random.Random(0))
    assert first.kept == list(range(8))
    every = roc.select(grp, RocSection(kind="grpo_all"), 8, random.Random(0))
    assert every.kept == list(range(16))


# ---------------------------------------------------------------------------- apply_roc
def test_apply_roc_fills_groups_and_rejects_equal_reward():
    mixed = signs(10, 6, seed=1)
    mixed.group_id = "mixed"
    right = group([rollout(i, 1.0) for i in range(16)], "right")
    wrong = group([rollout(i, 0.0) for i in range(16)], "wrong")
    stale = signs(8, 8)
    stale.dropped_reason = "stale"
    kept, m = roc.apply_roc([mixed, right, wrong, stale], RocSection(), 8, rng=7)
    assert [g.group_id for g in kept] == ["mixed"]
    assert right.dropped_reason == wrong.dropped_reason == "equal_reward"
    assert stale.dropped_reason == "stale" and stale.kept == []
    assert len(mixed.kept) == 8 and len(mixed.advantages) == 8
    rewards = [mixed.rollouts[i].reward for i in mixed.kept]
    assert sum(rewards) == 5                        # round(10 * 8 / 16)
    assert all((a > 0) == (r > 0) for a, r in zip(mixed.advantages, rewards, strict=True))
    assert abs(sum(mixed.advantages)) < 1e-9
    assert right.advantages == [0.0] * 8
    assert m["roc/groups"] == 3 and m["roc/groups_trained"] == 1
    assert m["roc/groups_equal_reward"] == 2
    assert m["roc/groups_all_correct"] == 1 and m["roc/groups_all_wrong"] == 1
    assert m["roc/rollouts_in"] == 48 and m["roc/rollouts_kept"] == 8
    assert m["roc/kept_pos"] == 5 + 8 and m["roc/kept_neg"] == 3 + 8
    assert m["roc/dropped_pos"] == 5 + 8 and m["roc/dropped_neg"] == 3 + 8


def test_apply_roc_reports_penalties_of_kept_and_dropped_positives():
    rs = [rollout(i, 1.0, ("ok",) * (3 - i % 4) + ("error",) * (i % 4)) for i in range(8)]
    rs += [rollout(8 + i, 0.0, ("error",)) for i in range(8)]
    grp = group(rs)
    _, m = roc.apply_roc([grp], RocSection(positive="lowest"), 8, rng=0)
    # 4 positives kept: the two with 0 errors and the two with 1/3
    assert m["roc/p_err_kept_pos"] == pytest.approx((0 + 0 + 1 / 3 + 1 / 3) / 4)
    assert m["roc/p_err_dropped_pos"] == pytest.approx((2 / 3 + 2 / 3 + 1 + 1) / 4)
    assert m["roc/p_total_kept_pos"] < m["roc/p_total_dropped_pos"]
    assert m["roc/p_format_kept_pos"] == 0.0
    assert m["roc/tool_error_ratio"] == pytest.approx((12 + 8) / (24 + 8))


def test_apply_roc_is_deterministic_for_a_seed():
    def run(seed):
        gs = [signs(9, 7, seed=s) for s in range(5)]
        roc.apply_roc(gs, RocSection(), 8, rng=seed)
        return [g.kept for g in gs]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_reject_equal_reward_off_keeps_uniform_groups():
    right = group([rollout(i, 1.0) for i in range(16)])
    kept, m = roc.apply_roc([right], RocSection(reject_equal_reward=False), 8, rng=0)
    assert kept == [right] and right.advantages == [0.0] * 8
    assert m["roc/groups_equal_reward"] == 0


@settings(max_examples=200, deadline=None)
@given(rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=10),
       failed=st.lists(st.booleans(), min_size=10, max_size=10),
       kind=st.sampled_from(sorted(roc.SELECT_KINDS)), floors=st.tuples(
           st.integers(0, 2), st.integers(0, 2)), group_size=st.integers(4, 8),
       seed=st.integers(0, 3))
def test_may_carry_signal_is_whether_apply_roc_keeps_the_group(rewards, failed, kind, floors,
                                                               group_size, seed):
    """The refill rule (`rollout.refill_equal_reward`) asks before RoC runs whether RoC will
    drop a group as `equal_reward`; with 0/1 rewards the answer is exact, whatever RoC draws
    (its floors at 0 included: then it may keep one side only)."""
    rs = [rollout(i, r) for i, r in enumerate(rewards)]
    for r, f in zip(rs, failed, strict=False):
        if f:
            r.status = RolloutStatus.FAILED
    cfg = RocSection(kind=kind, min_pos=floors[0], min_neg=floors[1])
    g = group(rs)
    expected = roc.may_carry_signal(g, cfg, group_size)
    kept, _ = roc.apply_roc([g], cfg, group_size, rng=seed)
    assert bool(kept) == expected, (g.dropped_reason, [r.reward for r in rs])
