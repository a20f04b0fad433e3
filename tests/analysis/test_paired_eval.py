"""Two evaluations paired by problem: the figures, the interval, and a running journal read."""

from __future__ import annotations

import json

import pytest

from asyncrl.analysis.paired_eval import compare, read_groups
from asyncrl.records import Group, Problem, Rollout, ToolCall, ToolStatus, to_json


def group(pid: str, source: str, rewards: list[float],
          calls: list[list[ToolStatus]] | None = None) -> Group:
    calls = calls or [[] for _ in rewards]
    return Group(group_id=pid, problem=Problem(id=pid, question="?", answer="1", source=source),
                 rollouts=[Rollout(rollout_id=f"{pid}{i}", prompt_id=pid, group_id=pid,
                                   policy_version=0, prompt_ids=[1], reward=w,
                                   tool_calls=[ToolCall(name="python", raw="c", status=s)
                                               for s in cs])
                           for i, (w, cs) in enumerate(zip(rewards, calls, strict=True))])


def test_pairs_by_problem_id_per_source_with_the_failed_calls_inside_correct_answers():
    ok, bad = ToolStatus.OK, ToolStatus.ERROR
    a = [group("p1", "rg/x", [1, 0, 0, 0], [[bad, ok], [ok], [], []]),
         group("p2", "rg/y", [1, 1, 0, 0]),
         group("only-a", "rg/x", [1, 1, 1, 1])]
    b = [group("p2", "rg/y", [1, 1, 1, 1]),  # another order, and a problem A lacks
         group("p1", "rg/x", [1, 1, 0, 0], [[ok], [ok], [bad], []]),
         group("only-b", "rg/y", [0, 0, 0, 0])]
    rows = compare(a, b)
    assert list(rows) == ["all", "rg/x", "rg/y"]
    x, y, both = rows["rg/x"], rows["rg/y"], rows["all"]
    assert (x["problems"], x["avg_a"], x["avg_b"], x["diff"]) == (1, 0.25, 0.5, 0.25)
    # A's one correct answer made two calls, one failed; B's two made one each, none failed
    # (the failed call of B's wrong answer does not count)
    assert x["tool_errors_correct_a"] == 0.5 and x["tool_errors_correct_b"] == 0.0
    assert (x["calls_correct_a"], x["calls_correct_b"]) == (2, 2)
    assert (y["avg_a"], y["avg_b"], y["diff"]) == (0.5, 1.0, 0.5)
    assert both["problems"] == 2 and both["diff"] == pytest.approx(0.375)
    # a single difference resamples to itself
    assert (x["diff_lo"], x["diff_hi"]) == (0.25, 0.25)
    assert both["diff_lo"] <= both["diff"] <= both["diff_hi"]


def test_the_interval_covers_the_spread_of_the_differences_and_is_seeded():
    a = [group(f"p{i}", "s", [0, 0]) for i in range(40)]
    b = [group(f"p{i}", "s", [1, 1] if i % 2 else [0, 0]) for i in range(40)]
    row = compare(a, b)["all"]
    assert row["diff"] == 0.5
    assert 0.25 < row["diff_lo"] < 0.5 < row["diff_hi"] < 0.75
    assert compare(a, b) == compare(a, b)  # the same bootstrap each time
    same = compare(a, a)["all"]
    assert (same["diff"], same["diff_lo"], same["diff_hi"]) == (0, 0, 0)


def test_no_shared_problem_or_another_set_under_the_same_ids_is_an_error():
    with pytest.raises(ValueError, match="share no problem"):
        compare([group("p1", "s", [1])], [group("p2", "s", [1])])
    other = group("p1", "s", [1])
    other.problem.question = "another question"
    with pytest.raises(ValueError, match="1 of the 1 shared problem ids"):
        compare([group("p1", "s", [1])], [other])


def test_a_repeated_id_counts_once_and_a_problem_without_answers_not_at_all():
    a = [group("p1", "s", [1, 1]), group("p1", "s", [0, 0]), group("p2", "s", [1])]
    b = [group("p1", "s", [0, 0]), group("p1", "s", [1, 1]), group("p2", "s", [])]
    row = compare(a, b)["all"]
    assert (row["problems"], row["avg_a"], row["avg_b"]) == (1, 1.0, 0.0)  # the first copies


def test_reads_a_running_journal_past_its_fingerprint_and_a_cut_last_line(tmp_path):
    g1, g2 = group("p1", "s", [1, 0]), group("p2", "s", [0, 0])
    journal = tmp_path / "eval_groups.jsonl.partial"
    journal.write_bytes(json.dumps({"k": 2, "problems": "abc"}).encode() + b"\n"
                        + to_json(g1) + b"\n" + to_json(g2)[:40])
    assert [g.problem.id for g in read_groups(journal)] == ["p1"]
    done = tmp_path / "eval_groups.jsonl"
    done.write_bytes(to_json(g1) + b"\n" + to_json(g2) + b"\n")
    assert [g.problem.id for g in read_groups(done)] == ["p1", "p2"]
    wrong = tmp_path / "metrics.jsonl"  # not an evaluation's file
    wrong.write_bytes(b'{"kind": "data"}\n{"kind": "stage"}\n{"kind": "done"}\n')
    with pytest.raises(ValueError, match="line 2 is not an evaluation group"):
        read_groups(wrong)
    wrong.write_bytes(b'{"kind": "data"}\n')
    with pytest.raises(ValueError, match="no evaluation groups"):
        read_groups(wrong)
