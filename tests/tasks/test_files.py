"""asyncrl.data: loading problem files, the overlong-prompt filter, and the resumable stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import data
from asyncrl.errors import DataError
from asyncrl.formats import PYTHON_TOOL_SCHEMA, get_format
from asyncrl.records import Problem

FIXTURES = Path(__file__).parents[1] / "data" / "fixtures"


def test_jsonl_bad_rows_counted_with_line_numbers() -> None:
    res = data.load_problems(str(FIXTURES / "problems.jsonl"), {}, 0, "train")
    assert [p.id for p in res.problems] == ["p1", "p2", "6"]
    assert res.problems[1].difficulty == 2.0 and res.problems[0].source == "hand"
    assert res.skipped == {"bad_json": 1, "bad_type": 1, "duplicate_id": 1, "empty_field": 1,
                           "missing_field": 1, "not_an_object": 1}
    joined = "\n".join(res.errors)
    assert "problems.jsonl:line 4: not valid JSON" in joined
    assert "line 5: missing field 'question'" in joined
    assert "line 6: field 'answer' must be a string, got int" in joined
    assert "line 7: duplicate id 'p1'" in joined
    assert res.num_skipped == 6


def test_parquet_and_json(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"id": "a", "question": "1+1?", "answer": "2", "source": "s", "difficulty": 1.0},
            {"id": "b", "question": "2+2?", "answer": None, "source": "s", "difficulty": None},
            {"id": "c", "question": "3+3?", "answer": "6", "source": "s", "difficulty": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    res = data.load_problems(str(tmp_path / "p.parquet"), {}, 0, "eval")
    assert [p.id for p in res.problems] == ["a", "c"]
    assert res.skipped == {"missing_field": 1}
    assert "p.parquet:row 2: missing field 'answer'" in res.errors[0]

    (tmp_path / "p.json").write_text(json.dumps(rows))
    res = data.load_problems(str(tmp_path / "p.json"), {}, 0, "eval")
    assert [p.id for p in res.problems] == ["a", "c"]


def test_unreadable_sources_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        data.load_problems(str(tmp_path / "none.jsonl"), {}, 0, "train")
    with pytest.raises(DataError, match=r"unknown data file type '\.csv'"):
        data.load_problems(str(tmp_path / "x.csv"), {}, 0, "train")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        data.load_problems(str(tmp_path / "bad.json"), {}, 0, "train")


def test_generator_source_delegates_to_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl import tasks
    from asyncrl.envs.source import clear_cache
    from asyncrl.tasks.base import TaskFamily

    calls = []

    def make(options, seed):
        calls.append((options, seed))
        return [Problem(id="t", question="q", answer="1")], [Problem(id="e", question="q", answer="2")]

    family = TaskFamily(name="arith", description="", defaults={"n": 1}, make=make,
                        solution_code=lambda p: "")
    monkeypatch.setitem(tasks.TASK_FAMILIES, "arith", family)
    clear_cache()
    try:
        assert data.load_problems("generator:arith", {"n": 3}, 7, "eval").problems[0].id == "e"
        assert data.load_problems("generator:arith", {"n": 3}, 7, "train").problems[0].id == "t"
    finally:
        clear_cache()
    assert calls == [({"n": 3}, 7)]  # one source per (name, options, seed): both splits of it


def test_overlong_prompts_skipped_and_counted(tiny_tokenizer) -> None:
    fmt = get_format("hermes")
    tools = [PYTHON_TOOL_SCHEMA]
    short = Problem(id="s", question="What is 2 + 3?", answer="5")
    long = Problem(id="l", question=" ".join(["What is 2 + 3?"] * 80), answer="5")
    base = len(tiny_tokenizer(data.prompt_text(short, fmt, tools))["input_ids"])
    long_n = len(tiny_tokenizer(data.prompt_text(long, fmt, tools))["input_ids"])
    # the limit sits between the two prompts: the tool schema alone is most of the short one
    limit = (base + long_n) // 2
    kept, n = data.filter_overlong([short, long, short], tiny_tokenizer, fmt, tools, limit)
    assert [p.id for p in kept] == ["s", "s"] and n == 1
    # the schema counts: without tools the long prompt is much shorter
    no_tools = len(tiny_tokenizer(data.prompt_text(long, fmt, None))["input_ids"])
    assert no_tools < long_n
    kept, n = data.filter_overlong([long], tiny_tokenizer, fmt, None, no_tools)
    assert n == 0
    kept, n = data.filter_overlong([short], tiny_tokenizer, fmt, tools, base - 1)
    assert kept == [] and n == 1


def test_load_split_folds_overlong_into_skipped(tmp_path: Path, tiny_tokenizer) -> None:
    fmt = get_format("markdown")
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "question": "1+1?", "answer": "2"},
            {"id": "b", "question": "9 " * 400, "answer": "9"},
            {"id": "c", "question": "2+2?", "answer": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = data.load_split(str(path), {}, 0, "train", tiny_tokenizer, fmt, None, 200)
    assert [p.id for p in res.problems] == ["a"]
    assert res.skipped == {"bad_type": 1, "overlong_prompt": 1}
    with pytest.raises(DataError, match="no usable train problems"):
        data.load_split(str(path), {}, 0, "train", tiny_tokenizer, fmt, None, 5)


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", question=f"q{i}", answer=str(i)) for i in range(n)]


def test_stream_epochs_are_permutations_and_seeded() -> None:
    probs = _problems(10)
    s = data.ProblemStream(probs, seed=3)
    e0 = [p.id for p in s.next_batch(10)]
    e1 = [p.id for p in s.next_batch(10)]
    assert sorted(e0) == sorted(e1) == sorted(p.id for p in probs)
    assert e0 != e1 and s.epoch == 1
    again = data.ProblemStream(probs, seed=3)
    assert [p.id for p in again.next_batch(20)] == e0 + e1
    other = data.ProblemStream(probs, seed=4)
    assert [p.id for p in other.next_batch(10)] != e0
    plain = data.ProblemStream(probs, seed=3, shuffle=False)
    assert [p.id for p in plain.next_batch(12)] == [f"p{i}" for i in range(10)] + ["p0", "p1"]


def test_stream_resumes_in_the_same_order() -> None:
    probs = _problems(7)
    ref = data.ProblemStream(probs, seed=1)
    expected = [p.id for p in ref.next_batch(3 * 9)]
    s = data.ProblemStream(probs, seed=1)
    got = [p.id for p in s.next_batch(3)] + [p.id for p in s.next_batch(3)]
    state = json.loads(json.dumps(s.state()))  # survives a checkpoint round trip
    resumed = data.ProblemStream.from_state(probs, state)
    for _ in range(7):
        got += [p.id for p in resumed.next_batch(3)]
    assert got == expected
    assert state["position"] == 6 and state["epoch"] == 0 and state["seed"] == 1


def test_stream_refuses_changed_data_and_bad_input() -> None:
    s = data.ProblemStream(_problems(5), seed=0)
    s.next_batch(2)
    with pytest.raises(DataError, match="differ from the checkpoint"):
        data.ProblemStream.from_state(_problems(6), s.state())
    with pytest.raises(DataError, match="bad data cursor"):
        data.ProblemStream.from_state(_problems(5), {"epoch": 0})
    with pytest.raises(DataError, match="empty"):
        data.ProblemStream([], seed=0)
    with pytest.raises(ValueError, match="batch size"):
        s.next_batch(0)
