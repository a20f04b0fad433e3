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


def test_a_resume_marks_the_rows_it_redoes_and_a_cut_line_is_ended(tmp_path) -> None:
    import json

    from asyncrl.observe.metrics import MetricsWriter
    from asyncrl.observe.report import load_metrics

    with MetricsWriter(tmp_path) as m:  # the first attempt: checkpoint after step 2
        for step in (1, 2, 3):
            m.write("rl_step", step=step)
        keep = 2
    with (tmp_path / "metrics.jsonl").open("ab") as f:
        f.write(b'{"kind": "rl_step", "st')  # killed mid-write
    with MetricsWriter(tmp_path) as m:  # the resumed attempt
        assert m.rows == 4  # the cut line was ended, so the next row stands on its own
        m.write("resumed", step=2, checkpoint="step_00000002", keep_rows=keep)
        for step in (3, 4):
            m.write("rl_step", step=step)
    raw = (tmp_path / "metrics.jsonl").read_text().split("\n")
    assert json.loads(raw[5]) == {**json.loads(raw[5]), "kind": "rl_step", "step": 3}
    rows = load_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r.get("step")) for r in rows] == [
        ("rl_step", 1), ("rl_step", 2), ("resumed", 2), ("rl_step", 3), ("rl_step", 4)]
