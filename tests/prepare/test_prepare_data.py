"""`asyncrl data prepare` (asyncrl/prepare/problems.py) on hand-written fixtures in each source's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import DataError
from asyncrl.prepare import problems as prep
from asyncrl.tasks.files import read_problem_file

FIXTURES = Path(__file__).parents[1] / "data" / "fixtures"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_dapo_strips_wrapper_keeps_english_and_accounts_for_every_row(tmp_path: Path) -> None:
    out = tmp_path / "dapo.jsonl"
    s = prep.prepare("dapo", [str(FIXTURES / "dapo_math_17k.jsonl")], out)
    rows = _read(out)
    assert [r["answer"] for r in rows] == ["34", "25", "12", "81"]
    assert rows[0]["question"].startswith("In triangle $ABC$")
    assert rows[0]["question"].endswith("when $AB = 34$.")
    for r in rows:
        assert "Solve the following" not in r["question"]
        assert "Remember to put" not in r["question"]
        assert r["source"] == "dapo_math_17k" and "difficulty" not in r
    assert rows[3]["question"] == "What is $3^4$?"  # a row without the wrapper is kept as is
    assert rows[0]["id"] == "dapo_math_17k-a8b7d1e2-0001"
    assert rows[2]["id"].startswith("dapo_math_17k-q")  # its index was already taken
    assert s.renamed_ids == 1
    assert s.skipped == {"bad_json": 1, "bad_prompt": 1, "missing_answer": 2, "non_english": 1}
    assert s.duplicates == 3 and s.duplicate_conflicts == 1
    assert s.rows_in == 12 == s.written + sum(s.skipped.values()) + s.duplicates
    assert "line 9" in s.examples["bad_json"]
    on_disk = json.loads((tmp_path / "dapo.summary.json").read_text())
    assert on_disk["written"] == 4 and on_disk["skipped"]["non_english"] == 1
    # the output is the project's format: the loader reads it back with nothing skipped
    loaded = read_problem_file(out)
    assert len(loaded.problems) == 4 and loaded.skipped == {}


def test_dapo_keep_non_english(tmp_path: Path) -> None:
    s = prep.prepare("dapo", [str(FIXTURES / "dapo_math_17k.jsonl")], tmp_path / "o.jsonl",
                     keep_non_english=True)
    assert s.written == 5 and "non_english" not in s.skipped


def test_dapo_from_parquet_matches_jsonl(tmp_path: Path) -> None:
    """The hub's parquet layout (nested list of messages and structs) gives the same problems."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = []
    for line in (FIXTURES / "dapo_math_17k.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row["prompt"], list) and "reward_model" in row:
            rows.append(row)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    prep.prepare("dapo", [str(tmp_path / "train.parquet")], tmp_path / "from_parquet.jsonl")
    prep.prepare("dapo", [str(FIXTURES / "dapo_math_17k.jsonl")], tmp_path / "from_jsonl.jsonl")
    assert (tmp_path / "from_parquet.jsonl").read_bytes() == \
        (tmp_path / "from_jsonl.jsonl").read_bytes()


def test_aime24_json(tmp_path: Path) -> None:
    out = tmp_path / "aime24.jsonl"
    s = prep.prepare("aime24", [str(FIXTURES / "aime_2024.json")], out)
    rows = _read(out)
    assert [(r["id"], r["answer"]) for r in rows] == [
        ("aime24-60", "204"), ("aime24-61", "113"), ("aime24-63", "25")]  # int answer -> text
    assert s.skipped == {"missing_answer": 1, "missing_question": 1}


def test_aime25_two_files_concatenated_with_hash_ids(tmp_path: Path) -> None:
    src = FIXTURES / "aime2025-I.jsonl"
    second = tmp_path / "aime2025-II.jsonl"
    second.write_text(json.dumps({"question": "Find $n$ such that $n^2 = 49$, $n > 0$.",
                                  "answer": "7"}) + "\n")
    out = tmp_path / "aime25.jsonl"
    s = prep.prepare("aime25", [str(src), str(second)], out)
    rows = _read(out)
    assert [r["answer"] for r in rows] == ["70", "588", "7"]
    assert all(r["id"].startswith("aime25-q") for r in rows)  # opencompass rows carry no id
    assert len({r["id"] for r in rows}) == 3
    assert s.skipped == {"missing_answer": 1, "not_an_object": 1}
    assert s.rows_in == 5


def test_math500_level_becomes_difficulty_and_answers_are_cleaned(tmp_path: Path) -> None:
    out = tmp_path / "math500.jsonl"
    s = prep.prepare("math500", [str(FIXTURES / "math500.jsonl")], out)
    rows = _read(out)
    assert rows[0] == {"id": "math500-test/precalculus/807.json",
                       "question": rows[0]["question"],
                       "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                       "source": "math500", "difficulty": 2.0}
    assert rows[2]["answer"] == "9"  # "$9$" unwrapped
    assert s.skipped == {"bad_answer": 1}
    assert s.written == 4


def test_idempotent_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "x.jsonl"
    prep.prepare("dapo", [str(FIXTURES / "dapo_math_17k.jsonl")], out)
    first = out.read_bytes(), (tmp_path / "x.summary.json").read_bytes()
    prep.prepare("dapo", [str(FIXTURES / "dapo_math_17k.jsonl")], out)
    assert (out.read_bytes(), (tmp_path / "x.summary.json").read_bytes()) == first


def test_clean_answer_rules() -> None:
    assert prep.clean_answer(" \\boxed{\\frac{1}{2}} ") == "\\frac{1}{2}"
    assert prep.clean_answer("\\boxed{1}+\\boxed{2}") == "\\boxed{1}+\\boxed{2}"  # not one box
    assert prep.clean_answer(7.0) == "7"
    for bad, reason in [(None, "missing_answer"), ("$ $", "missing_answer"),
                        (True, "bad_answer"), (float("nan"), "bad_answer"),
                        ({"a": 1}, "bad_answer")]:
        with pytest.raises(prep.Skip) as e:
            prep.clean_answer(bad)
        assert e.value.reason == reason


def test_missing_input_file_and_nothing_usable_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        prep.prepare("aime24", [str(tmp_path / "nope.parquet")], tmp_path / "o.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"question": "q", "answer": ""}\n')
    with pytest.raises(DataError, match="no usable rows"):
        prep.prepare("aime25", [str(empty)], tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from asyncrl.cli import data

    parser = argparse.ArgumentParser(prog="asyncrl")
    data.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "m.jsonl"
    args = parser.parse_args(["data", "prepare", "math500", "-i",
                              str(FIXTURES / "math500.jsonl"), "-o", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "written" in printed and "skipped: bad_answer" in printed
    assert len(_read(out)) == 4
