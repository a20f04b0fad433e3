"""asyncrl.tasks.files: reading problem files (JSONL, JSON, parquet), bad rows counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import DataError
from asyncrl.tasks.files import read_problem_file

FIXTURES = Path(__file__).parents[1] / "data" / "fixtures"


def test_jsonl_bad_rows_counted_with_line_numbers() -> None:
    res = read_problem_file(str(FIXTURES / "problems.jsonl"))
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
    res = read_problem_file(str(tmp_path / "p.parquet"))
    assert [p.id for p in res.problems] == ["a", "c"]
    assert res.skipped == {"missing_field": 1}
    assert "p.parquet:row 2: missing field 'answer'" in res.errors[0]

    (tmp_path / "p.json").write_text(json.dumps(rows))
    res = read_problem_file(str(tmp_path / "p.json"))
    assert [p.id for p in res.problems] == ["a", "c"]


def test_unreadable_sources_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_problem_file(str(tmp_path / "none.jsonl"))
    with pytest.raises(DataError, match=r"unknown data file type '\.csv'"):
        read_problem_file(str(tmp_path / "x.csv"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_problem_file(str(tmp_path / "bad.json"))
