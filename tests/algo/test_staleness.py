"""The staleness rules: wave admission, group lag, the keep/drop rule, batch version stats,
and the per-token lags the trainers receive."""

from __future__ import annotations

import pytest

from asyncrl.algo.batching import pack, sequences_from_batch
from asyncrl.algo.staleness import (
    group_lag,
    rollout_lag,
    split_stale,
    version_stats,
    waves_allowed,
)
from asyncrl.records import Batch, Group, Problem, Rollout


def _ro(versions: list[int], mask: list[int], rid: str = "r", version: int | None = None
        ) -> Rollout:
    n = len(versions)
    return Rollout(rollout_id=rid, prompt_id="p", group_id="g",
                   policy_version=min(versions) if version is None else version,
                   prompt_ids=[1, 2], response_ids=list(range(10, 10 + n)), loss_mask=mask,
                   logprobs=[-0.5] * n, token_versions=versions)


def _group(*rollouts: Rollout, gid: str = "g") -> Group:
    return Group(group_id=gid, problem=Problem(id=gid, question="q", answer="1"),
                 rollouts=list(rollouts))


@pytest.mark.parametrize(("done", "n", "total", "want"), [
    (0, 0, 10, 1),   # synchronous: one wave, the next after this step's update
    (3, 0, 10, 4),
    (0, 2, 10, 3),   # N = 2: three waves under way from the start
    (5, 2, 10, 8),
    (5, 2, 6, 6),    # never beyond the stage's steps
])
def test_waves_allowed(done, n, total, want):
    assert waves_allowed(done, n, total) == want


def test_waves_allowed_refuses_negative_staleness():
    with pytest.raises(ValueError):
        waves_allowed(0, -1, 3)


def test_lag_counts_the_oldest_trained_token():
    # updated in flight: tokens of versions 3 then 4; the tool token (mask 0) of version 2
    # does not count
    ro = _ro([2, 3, 3, 4], [0, 1, 1, 1])
    assert rollout_lag(ro, 5) == 2
    assert rollout_lag(ro, 3) == 0
    g = _group(ro, _ro([5, 5], [1, 1], "r2"))
    assert group_lag(g, 5) == 2


def test_records_without_token_versions_use_the_rollout_version():
    ro = Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=4, prompt_ids=[1],
                 response_ids=[7, 8], loss_mask=[1, 1], logprobs=[0.0, 0.0])
    assert ro.versions() == [4, 4] and rollout_lag(ro, 6) == 2


def test_split_stale_drops_groups_over_the_bound_and_marks_them():
    old = _group(_ro([1, 2], [1, 1]), gid="old")
    ok = _group(_ro([2, 3], [1, 1]), gid="ok")
    kept, dropped = split_stale([old, ok], 4, 2)
    assert [g.group_id for g in kept] == ["ok"] and [g.group_id for g in dropped] == ["old"]
    assert old.dropped_reason == "stale" and ok.dropped_reason == ""


def test_version_stats_by_hand():
    # at version 4: trained tokens with lags 2, 1, 0 | 0, 0 -> 2 stale of 5, max 2, mean 3/5;
    # the first rollout mixes versions 2 and 3 (updated mid-generation)
    g1 = _group(_ro([2, 3, 4, 4], [1, 1, 0, 1], "a"), _ro([4, 4], [1, 1], "b"), gid="g1")
    g2 = _group(_ro([4], [1], "c"), gid="g2")
    s = version_stats([g1, g2], 4)
    assert s["async/stale_token_frac"] == pytest.approx(2 / 6)
    assert s["async/version_lag_max"] == 2.0
    assert s["async/version_lag_mean"] == pytest.approx(3 / 6)
    assert s["async/mixed_version_rollouts"] == 1.0
    assert s["async/groups_stale_kept"] == 1.0
    assert version_stats([], 4)["async/stale_token_frac"] == 0.0


def test_check_refuses_token_versions_of_the_wrong_length():
    ro = _ro([1, 1], [1, 1])
    ro.token_versions = [1]
    with pytest.raises(ValueError, match="token versions"):
        ro.check()


def test_trainers_get_per_token_lags():
    g = _group(_ro([2, 3, 4], [1, 0, 1], "a"), _ro([4, 4, 4], [1, 1, 1], "b"))
    g.kept, g.advantages = [0, 1], [1.0, -1.0]
    seqs = sequences_from_batch(Batch(step=1, policy_version=4, groups=[g]))
    assert seqs[0].lags == [0, 0, 2, 1, 0] and seqs[1].lags == [0] * 5
    packed = pack(seqs, 1000)
    assert len(packed) == 1 and packed[0].lags == [0, 0, 2, 1, 0] + [0] * 5
