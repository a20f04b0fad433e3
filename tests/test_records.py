"""Records round-trip through JSON lines and keep their invariants."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import records as R


def sample_rollout() -> R.Rollout:
    return R.Rollout(
        rollout_id="r0", prompt_id="p0", group_id="g0", policy_version=3,
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13, 14],
        loss_mask=[1, 1, 0, 0, 1],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        turns=[R.Turn(role="assistant", start=0, end=2, tool_call=0),
               R.Turn(role="tool", start=2, end=4, tool_call=0),
               R.Turn(role="assistant", start=4, end=5)],
        tool_calls=[R.ToolCall(name="python", arguments={"code": "1/0"}, status=R.ToolStatus.ERROR,
                               output="ZeroDivisionError", exit_code=1, duration_s=0.01)],
        answer="42", reward=1.0, reward_status="ok", status=R.RolloutStatus.COMPLETED,
        stop_reason=R.StopReason.NO_TOOL_CALL, engine="local-0",
        timing=R.Timing(queued_s=0.1, generation_s=1.0, tool_wait_s=0.02, total_s=1.2),
    )


def test_rollout_round_trip_jsonl(tmp_path: Path) -> None:
    r = sample_rollout()
    r.check()
    g = R.Group(group_id="g0", problem=R.Problem(id="p0", question="q", answer="42"),
                rollouts=[r, r], kept=[1], advantages=[0.5])
    path = tmp_path / "groups.jsonl"
    with path.open("wb") as fp:
        assert R.write_jsonl(fp, [g, g]) == 2
    back = R.read_jsonl(path, R.Group)
    assert back == [g, g]
    assert back[0].kept_rollouts[0].tool_calls[0].status is R.ToolStatus.ERROR
    assert back[0].rollouts[0].tool_error_ratio == 1.0


def test_batch_iterates_kept_with_advantages() -> None:
    r = sample_rollout()
    g = R.Group(group_id="g0", problem=R.Problem(id="p0", question="q", answer="1"),
                rollouts=[r, r, r], kept=[0, 2], advantages=[1.0, -1.0])
    b = R.Batch(step=1, policy_version=0, groups=[g])
    assert [a for _, a in b.rollouts()] == [1.0, -1.0]
    assert R.from_json(R.to_json(b), R.Batch) == b


def test_check_catches_misaligned_lists() -> None:
    r = sample_rollout()
    r.loss_mask.append(1)
    with pytest.raises(ValueError, match="lengths"):
        r.check()
    r = sample_rollout()
    r.turns[1].start = 3
    with pytest.raises(ValueError, match="contiguous"):
        r.check()


def test_routed_experts_travel_as_base64_bytes_not_lists():
    """A routing record is a few bytes per token and layer in JSON (base64), not a list per
    token, and survives the round trip; `fitted` cuts or pads with the `missing` value."""
    from asyncrl.records import Rollout, RoutedExperts, from_json, to_json

    tokens, layers, k = 300, 4, 2
    data = bytes((t * 7 + i) % 8 for t in range(tokens) for i in range(layers * k))
    rec = RoutedExperts(layers=layers, top_k=k, data=data)
    ro = Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=0,
                 prompt_ids=[1] * tokens, routed_experts=rec)
    raw = to_json(ro)
    assert len(raw) < 4 * len(data)  # base64 (4/3) plus the rest of the record
    back = from_json(raw, Rollout)
    assert back.routed_experts == rec and back.routed_experts.tokens == tokens
    longer = rec.fitted(tokens + 2)
    assert longer.tokens == tokens + 2 and longer.data[-layers * k:] == b"\xff" * (layers * k)
    assert rec.fitted(10).data == data[:10 * layers * k]
    assert RoutedExperts(layers=1, top_k=1, itemsize=2).missing == 0xFFFF
