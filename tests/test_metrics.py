"""Rollout statistics written each RL step."""

from __future__ import annotations

import pytest

from asyncrl.observe.metrics import rollout_stats
from asyncrl.records import Rollout, ToolCall, ToolStatus


def rollout(i: int, reward: float, statuses: tuple[str, ...]) -> Rollout:
    return Rollout(rollout_id=f"r{i}", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[1], reward=reward,
                   tool_calls=[ToolCall(name="python", status=ToolStatus(s)) for s in statuses])


def test_tool_error_ratios_are_over_calls_with_their_counts() -> None:
    rs = [rollout(0, 1.0, ("ok", "error", "ok")), rollout(1, 1.0, ("timeout",)),
          rollout(2, 0.0, ("error", "error")), rollout(3, 1.0, ())]
    s = rollout_stats(rs)
    assert s["rollout/tool_error_ratio"] == pytest.approx(4 / 6)
    # positives: 4 calls, 2 failed (the positive without calls adds nothing)
    assert s["rollout/tool_error_ratio_pos"] == pytest.approx(2 / 4)
    assert (s["rollout/tool_calls_pos"], s["rollout/tool_errors_pos"]) == (4.0, 2.0)
    assert s["rollout/tool_use_frac"] == 0.75
    empty = rollout_stats([rollout(0, 0.0, ())])
    assert empty["rollout/tool_error_ratio_pos"] == 0.0 and empty["rollout/tool_calls_pos"] == 0.0


def test_reward_host_failures_are_counted_beside_timeouts() -> None:
    rs = [rollout(i, 0.0, ()) for i in range(4)]
    for r, status in zip(rs, ("reward_error", "reward_error", "reward_timeout", "ok"), strict=True):
        r.reward_status = status
    s = rollout_stats(rs)
    assert (s["rollout/reward_error_count"], s["rollout/reward_timeout_count"]) == (2.0, 1.0)
