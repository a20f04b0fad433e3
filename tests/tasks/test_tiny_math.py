"""tiny_math task family: seeded, split, exact, levelled, and strict about its options."""

from __future__ import annotations

import re

import pytest

from asyncrl.sft.coldstart import corpus, run_trusted
from asyncrl.tasks import families as tasks

OPTS = {"train_size": 300, "eval_size": 60, "levels": [1, 2, 3, 4]}

# Written independently of the family's own `Form.solve` and code templates.
_INDEPENDENT = [
    (r"What is (\d+) plus (\d+)\?", lambda a, b: a + b),
    (r"What is (\d+) minus (\d+)\?", lambda a, b: a - b),
    (r"What is (\d+) times (\d+)\?", lambda a, b: a * b),
    (r"What is (\d+) times (\d+) times (\d+)\?", lambda a, b, c: a * b * c),
    (r"What is the remainder when (\d+) is divided by (\d+)\?", lambda a, b: a - a // b * b),
    (r"What is (\d+) to the power (\d+) modulo (\d+)\?", lambda a, b, m: a**b % m),
    (r"What is the sum of the integers from (\d+) to (\d+)\?", lambda a, b: sum(range(a, b + 1))),
    (r"How many multiples of (\d+) are there from (\d+) to (\d+)\?",
     lambda k, a, b: len([n for n in range(a, b + 1) if n % k == 0])),
    (r"Solve (\d+) \* x \+ (\d+) = (\d+) for x\.",
     lambda a, b, c: next(x for x in range(10**6) if a * x + b == c)),
    (r"What is the sum of the digits of (\d+) to the power (\d+)\?",
     lambda a, b: sum(map(int, str(a**b)))),
    (r"What is (\d+) times (\d+) minus (\d+) times (\d+)\?", lambda a, b, c, d: a * b - c * d),
]


def _independent_answer(question: str) -> int:
    for pattern, solve in _INDEPENDENT:
        m = re.fullmatch(pattern, question)
        if m:
            return solve(*map(int, m.groups()))
    raise AssertionError(f"unrecognised question {question!r}")


def test_same_seed_same_problems_other_seed_other_problems() -> None:
    a = tasks.generate("tiny_math", OPTS, seed=3)
    assert a == tasks.generate("tiny_math", OPTS, seed=3)
    b = tasks.generate("tiny_math", OPTS, seed=4)
    assert [p.question for p in a[0]] != [p.question for p in b[0]]
    # seed_offset shifts the seed
    assert tasks.generate("tiny_math", {**OPTS, "seed_offset": 1}, seed=3) == b


def test_eval_split_is_stable_when_train_size_changes() -> None:
    _, ev1 = tasks.generate("tiny_math", OPTS, seed=0)
    _, ev2 = tasks.generate("tiny_math", {**OPTS, "train_size": 50}, seed=0)
    assert ev1 == ev2


def test_sizes_ids_and_disjoint_questions() -> None:
    train, ev = tasks.generate("tiny_math", OPTS, seed=0)
    assert len(train) == 300 and len(ev) == 60
    assert train[123].id == "tiny_math-train-000123" and ev[0].id == "tiny_math-eval-000000"
    tq, eq = {p.question for p in train}, {p.question for p in ev}
    assert len(tq) == len(train) and len(eq) == len(ev)
    assert not tq & eq
    assert all(p.source == "tiny_math" for p in train + ev)


def test_answers_are_exact_and_the_solution_program_prints_them() -> None:
    train, ev = tasks.generate("tiny_math", OPTS, seed=1)
    for p in train + ev:
        assert p.answer == str(_independent_answer(p.question)), p
        status, stdout, _ = run_trusted(tasks.solution_code(p))
        assert status == "ok" and stdout.strip() == p.answer, p


def test_numbers_in_the_solution_program_are_copied_from_the_question() -> None:
    train, _ = tasks.generate("tiny_math", OPTS, seed=2)
    for p in train:
        q_numbers = set(re.findall(r"\d+", p.question))
        code_numbers = set(re.findall(r"\d+", tasks.solution_code(p))) - {"0", "1"}
        assert code_numbers <= q_numbers, (p.question, tasks.solution_code(p))


def test_levels_are_respected_and_balanced() -> None:
    train, ev = tasks.generate("tiny_math", {"train_size": 90, "eval_size": 30,
                                             "levels": [1, 3]}, seed=0)
    for split in (train, ev):
        counts = {lv: sum(p.difficulty == lv for p in split) for lv in (1, 2, 3, 4)}
        assert counts[2] == counts[4] == 0 and counts[1] == counts[3] == len(split) // 2
    easy, _ = tasks.generate("tiny_math", {"train_size": 200, "eval_size": 0, "levels": [1]}, 0)
    for p in easy:
        assert max(map(int, re.findall(r"\d+", p.question))) <= 99
        assert re.fullmatch(r"What is \d+ (plus|minus|times) \d+\?", p.question)
    hard, _ = tasks.generate("tiny_math", {"train_size": 200, "eval_size": 0, "levels": [3]}, 0)
    # level 3 answers are beyond mental arithmetic for a small model: mostly 3+ digits
    assert sum(len(p.answer) >= 3 for p in hard) / len(hard) > 0.6


def test_level_4_has_a_two_step_program_and_a_reordered_one() -> None:
    """Level 4 is not a literal copy: an equation's program reorders the numbers, and
    `diff_products` goes through intermediate variables over three lines."""
    train, _ = tasks.generate("tiny_math", {"train_size": 400, "eval_size": 0, "levels": [4]}, 0)
    codes = {p.question: tasks.solution_code(p) for p in train}
    multi = [c for c in codes.values() if c.count("\n") == 2 and "x = " in c]
    assert len(multi) > 50
    eq = next(q for q in codes if q.startswith("Solve"))
    a, b, c = re.findall(r"\d+", eq)
    assert codes[eq] == f"print(({c} - {b}) // {a})"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train_sise": 10}, "'train_sise'"),
        ({"levels": [1, 9]}, "'levels'"),
        ({"levels": []}, "'levels'"),
        ({"levels": 2}, "'levels'"),
        ({"train_size": 0}, "'train_size'"),
        ({"eval_size": -1}, "'eval_size'"),
        ({"train_size": "100"}, "'train_size'"),
        ({"train_size": True}, "'train_size'"),
    ],
)
def test_bad_options_name_the_option(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tasks.generate("tiny_math", options, seed=0)


def test_unknown_family_and_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
        tasks.generate("nope", {}, seed=0)
    # level 1 minus/plus/times: ~10k distinct questions at most
    with pytest.raises(ValueError, match="distinct"):
        tasks.generate("tiny_math", {"train_size": 20000, "eval_size": 0, "levels": [1]}, 0)


def test_corpus_covers_the_markup_of_both_formats() -> None:
    train, _ = tasks.generate("tiny_math", {"train_size": 30, "eval_size": 5}, 0)
    text = "\n".join(corpus("tiny_math", train, tasks.solution_code, seed=0))
    for mark in ["<|im_start|>system", "<reason>", "</answer>", "\\boxed{", "```python\n",
                 "```output\n", "<tool_call>", "<tool_response>", "Execution failed (error).",
                 "Execution succeeded.", "<|im_end|>"]:
        assert mark in text, mark
