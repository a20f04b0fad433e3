"""asyncrl.tasks.stream: the overlong-prompt filter and the resumable problem stream; and
`asyncrl.tasks.open.load_task`, which reads a task's splits once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import DataError
from asyncrl.formats import PYTHON_TOOL_SCHEMA, get_format
from asyncrl.records import Problem
from asyncrl.tasks import stream
from asyncrl.tasks.files import read_problem_file
from asyncrl.tasks.open import TaskSpec, load_task


def test_one_source_serves_both_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.tasks import families
    from asyncrl.tasks.families.base import TaskFamily

    calls = []

    def make(options, seed):
        calls.append((options, seed))
        return [Problem(id="t", question="q", answer="1")], [Problem(id="e", question="q", answer="2")]

    family = TaskFamily(name="arith", description="", defaults={"n": 1}, make=make,
                        solution_code=lambda p: "")
    monkeypatch.setitem(families.TASK_FAMILIES, "arith", family)
    loaded = load_task(TaskSpec(train="generator:arith", eval="generator:arith",
                                options={"n": 3}, seed=7))
    assert loaded.train is not None and loaded.eval is not None
    assert [p.id for p in loaded.train.problems] == ["t"]
    assert [p.id for p in loaded.eval.problems] == ["e"]
    assert calls == [({"n": 3}, 7)]  # one source for both splits, built once
    load_task(TaskSpec(train="generator:arith", eval="generator:arith", options={"n": 3},
                       seed=7))
    assert len(calls) == 2  # no cache between opens: each open builds its source anew


def test_overlong_prompts_skipped_and_counted(tiny_tokenizer) -> None:
    fmt = get_format("hermes")
    tools = [PYTHON_TOOL_SCHEMA]
    short = Problem(id="s", question="What is 2 + 3?", answer="5")
    long = Problem(id="l", question=" ".join(["What is 2 + 3?"] * 80), answer="5")
    base = len(tiny_tokenizer(stream.prompt_text(short, fmt, tools))["input_ids"])
    long_n = len(tiny_tokenizer(stream.prompt_text(long, fmt, tools))["input_ids"])
    # the limit sits between the two prompts: the tool schema alone is most of the short one
    limit = (base + long_n) // 2
    kept, n = stream.filter_overlong([short, long, short], tiny_tokenizer, fmt, tools, limit)
    assert [p.id for p in kept] == ["s", "s"] and n == 1
    # the schema counts: without tools the long prompt is much shorter
    no_tools = len(tiny_tokenizer(stream.prompt_text(long, fmt, None))["input_ids"])
    assert no_tools < long_n
    kept, n = stream.filter_overlong([long], tiny_tokenizer, fmt, None, no_tools)
    assert n == 0
    kept, n = stream.filter_overlong([short], tiny_tokenizer, fmt, tools, base - 1)
    assert kept == [] and n == 1


def test_filter_split_folds_overlong_into_skipped(tmp_path: Path, tiny_tokenizer) -> None:
    fmt = get_format("markdown")
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "question": "1+1?", "answer": "2"},
            {"id": "b", "question": "9 " * 400, "answer": "9"},
            {"id": "c", "question": "2+2?", "answer": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    read = read_problem_file(path)
    res = stream.filter_split(read, str(path), "train", tiny_tokenizer, fmt, None, 200)
    assert [p.id for p in res.problems] == ["a"]
    assert res.skipped == {"bad_type": 1, "overlong_prompt": 1}
    with pytest.raises(DataError, match="no usable train problems"):
        stream.filter_split(read, str(path), "train", tiny_tokenizer, fmt, None, 5)


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", question=f"q{i}", answer=str(i)) for i in range(n)]


def test_stream_epochs_are_permutations_and_seeded() -> None:
    probs = _problems(10)
    s = stream.ProblemStream(probs, seed=3)
    e0 = [p.id for p in s.next_batch(10)]
    e1 = [p.id for p in s.next_batch(10)]
    assert sorted(e0) == sorted(e1) == sorted(p.id for p in probs)
    assert e0 != e1 and s.epoch == 1
    again = stream.ProblemStream(probs, seed=3)
    assert [p.id for p in again.next_batch(20)] == e0 + e1
    other = stream.ProblemStream(probs, seed=4)
    assert [p.id for p in other.next_batch(10)] != e0
    plain = stream.ProblemStream(probs, seed=3, shuffle=False)
    assert [p.id for p in plain.next_batch(12)] == [f"p{i}" for i in range(10)] + ["p0", "p1"]


def test_stream_resumes_in_the_same_order() -> None:
    probs = _problems(7)
    ref = stream.ProblemStream(probs, seed=1)
    expected = [p.id for p in ref.next_batch(3 * 9)]
    s = stream.ProblemStream(probs, seed=1)
    got = [p.id for p in s.next_batch(3)] + [p.id for p in s.next_batch(3)]
    state = json.loads(json.dumps(s.state()))  # survives a checkpoint round trip
    resumed = stream.ProblemStream.from_state(probs, state)
    for _ in range(7):
        got += [p.id for p in resumed.next_batch(3)]
    assert got == expected
    assert state["position"] == 6 and state["epoch"] == 0 and state["seed"] == 1


def test_stream_refuses_changed_data_and_bad_input() -> None:
    s = stream.ProblemStream(_problems(5), seed=0)
    s.next_batch(2)
    with pytest.raises(DataError, match="differ from the checkpoint"):
        stream.ProblemStream.from_state(_problems(6), s.state())
    with pytest.raises(DataError, match="bad data cursor"):
        stream.ProblemStream.from_state(_problems(5), {"epoch": 0})
    with pytest.raises(DataError, match="empty"):
        stream.ProblemStream([], seed=0)
    with pytest.raises(ValueError, match="batch size"):
        s.next_batch(0)


def _grouped(n: int = 30) -> list[Problem]:
    """A source's list grouped as reasoning-gym's is: one generator's problems, then the next."""
    return [Problem(id=f"{g}{i}", question=f"{g} {i}", answer="1", source=g)
            for g in ("eq", "gsm", "sum") for i in range(n)]


def test_a_held_out_cut_spreads_over_a_grouped_set_and_is_the_same_every_time() -> None:
    probs = _grouped()
    cut = stream.held_out_cut(probs, 12)
    assert len(cut) == 12 and len({p.id for p in cut}) == 12
    assert {p.source for p in cut} == {"eq", "gsm", "sum"}  # not the first group's 12
    assert [probs.index(p) for p in cut] == sorted(probs.index(p) for p in cut)  # list order
    assert cut == stream.held_out_cut(probs, 12)  # every evaluation, run and seed
    assert stream.held_out_cut(probs, 0) == probs == stream.held_out_cut(probs, 500)
