"""`tiny_math`: short templated arithmetic word problems whose exact answers need a tool.

Owns: the question forms, the number ranges of each difficulty level, and the train/eval split.
Built for a ~1M-parameter model that learns for a few minutes on a CPU (the tiny curriculum):
- questions are one short sentence from a handful of templates;
- every number the solution needs appears verbatim in the question, so the program that
  answers it is a copy with fixed glue (`What is 4821 times 372?` -> `print(4821 * 372)`);
  from level 4 the glue is no longer a literal copy: the numbers are reordered (equations) or
  the program takes two steps through intermediate variables (`diff_products`);
- answers are integers, checked exactly.

Levels: 1 is two-digit addition/subtraction and one-by-two-digit products, which a small model
sometimes gets right "in its head"; 2 is four-digit sums, three-by-two-digit products and
remainders; 3 is four-by-three-digit products, modular powers, sums of ranges and counts of
multiples; 4 is linear equations, triple products, digit sums of powers and differences of two
products (a three-line program). From level 2 up a
model without the tool essentially never produces the exact answer.

Options: `train_size`, `eval_size`, `levels` (list of ints from 1-4), `seed_offset` (added to
the run seed). The eval split is drawn first from its own seeded stream, so it does not change
when `train_size` does; train questions never repeat an eval question (nor each other).
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.records import Problem
from asyncrl.tasks.families.base import Form, Sampler, TaskFamily, digits, draw_split

NAME = "tiny_math"

PLUS = Form("plus", "What is {a} plus {b}?", "print({a} + {b})", lambda a, b: a + b)
MINUS = Form("minus", "What is {a} minus {b}?", "print({a} - {b})", lambda a, b: a - b)
TIMES = Form("times", "What is {a} times {b}?", "print({a} * {b})", lambda a, b: a * b)
MOD = Form("mod", "What is the remainder when {a} is divided by {b}?", "print({a} % {b})",
           lambda a, b: a % b)
POWMOD = Form("powmod", "What is {a} to the power {b} modulo {m}?", "print(pow({a}, {b}, {m}))",
              lambda a, b, m: pow(a, b, m))
RANGE_SUM = Form("range_sum", "What is the sum of the integers from {a} to {b}?",
                 "print(sum(range({a}, {b} + 1)))", lambda a, b: (a + b) * (b - a + 1) // 2)
COUNT_MULTIPLES = Form("count_multiples", "How many multiples of {k} are there from {a} to {b}?",
                       "print(sum(n % {k} == 0 for n in range({a}, {b} + 1)))",
                       lambda k, a, b: b // k - (a - 1) // k)
EQUATION = Form("equation", "Solve {a} * x + {b} = {c} for x.", "print(({c} - {b}) // {a})",
                lambda a, b, c: (c - b) // a)
TIMES3 = Form("times3", "What is {a} times {b} times {c}?", "print({a} * {b} * {c})",
              lambda a, b, c: a * b * c)
DIGIT_SUM = Form("digit_sum", "What is the sum of the digits of {a} to the power {b}?",
                 "print(sum(int(d) for d in str({a} ** {b})))",
                 lambda a, b: sum(int(d) for d in str(a**b)))

DIFF_PRODUCTS = Form("diff_products", "What is {a} times {b} minus {c} times {d}?",
                     "x = {a} * {b}\ny = {c} * {d}\nprint(x - y)",
                     lambda a, b, c, d: a * b - c * d)

FORMS: tuple[Form, ...] = (PLUS, MINUS, TIMES, MOD, POWMOD, RANGE_SUM, COUNT_MULTIPLES, EQUATION,
                           TIMES3, DIGIT_SUM, DIFF_PRODUCTS)


def _minus(rng: random.Random) -> dict[str, int]:
    a = rng.randint(20, 99)
    return {"a": a, "b": rng.randint(10, a - 1)}


def _range(rng: random.Random) -> dict[str, int]:
    a = rng.randint(10, 500)
    return {"a": a, "b": rng.randint(a + 100, 3000)}


def _multiples(rng: random.Random) -> dict[str, int]:
    a = rng.randint(100, 999)
    return {"k": rng.randint(3, 19), "a": a, "b": rng.randint(a + 500, 9999)}


def _equation(rng: random.Random) -> dict[str, int]:
    a, x, b = rng.randint(11, 99), digits(rng, 3), digits(rng, 3)
    return {"a": a, "b": b, "c": a * x + b}


LEVELS: dict[int, list[tuple[Form, Sampler]]] = {
    1: [
        (PLUS, lambda r: {"a": digits(r, 2), "b": digits(r, 2)}),
        (MINUS, _minus),
        (TIMES, lambda r: {"a": r.randint(2, 9), "b": digits(r, 2)}),
    ],
    2: [
        (PLUS, lambda r: {"a": digits(r, 4), "b": digits(r, 4)}),
        (TIMES, lambda r: {"a": digits(r, 3), "b": digits(r, 2)}),
        (MOD, lambda r: {"a": digits(r, 4), "b": r.randint(11, 97)}),
    ],
    3: [
        (TIMES, lambda r: {"a": digits(r, 4), "b": digits(r, 3)}),
        (POWMOD, lambda r: {"a": digits(r, 2), "b": digits(r, 2), "m": r.randint(11, 99)}),
        (RANGE_SUM, _range),
        (COUNT_MULTIPLES, _multiples),
    ],
    4: [
        (EQUATION, _equation),
        (TIMES3, lambda r: {"a": digits(r, 3), "b": digits(r, 3), "c": digits(r, 3)}),
        (DIGIT_SUM, lambda r: {"a": r.randint(2, 99), "b": r.randint(10, 40)}),
        # a * b >= 1000 > c * d: the answer is positive
        (DIFF_PRODUCTS, lambda r: {"a": digits(r, 3), "b": digits(r, 2), "c": digits(r, 2),
                                   "d": r.randint(2, 9)}),
    ],
}

DEFAULTS: dict[str, Any] = {"train_size": 1000, "eval_size": 100, "levels": [1, 2, 3],
                            "seed_offset": 0}


def _check(opts: dict[str, Any]) -> None:
    if opts["train_size"] < 1:
        raise ValueError(f"{NAME}: option 'train_size' must be >= 1, got {opts['train_size']}")
    if opts["eval_size"] < 0:
        raise ValueError(f"{NAME}: option 'eval_size' must be >= 0, got {opts['eval_size']}")
    if not opts["levels"]:
        raise ValueError(f"{NAME}: option 'levels' must list at least one level")
    bad = [lv for lv in opts["levels"] if lv not in LEVELS]
    if bad:
        raise ValueError(f"{NAME}: option 'levels' has unknown level {bad[0]}; "
                         f"levels are {sorted(LEVELS)}")


def make(opts: dict[str, Any], seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) for resolved options; deterministic for (options, seed)."""
    s = seed + opts["seed_offset"]
    taken: set[str] = set()
    eval_set = draw_split("eval", NAME, opts["eval_size"], opts["levels"], LEVELS,
                          random.Random(f"{NAME}/eval/{s}"), taken)
    train = draw_split("train", NAME, opts["train_size"], opts["levels"], LEVELS,
                       random.Random(f"{NAME}/train/{s}"), taken)
    return train, eval_set


def solution_code(problem: Problem) -> str:
    """The program that prints `problem`'s answer, rebuilt from the numbers in its question."""
    for form in FORMS:
        slots = form.match(problem.question)
        if slots is not None:
            return form.code.format(**slots)
    raise ValueError(f"{NAME}: question of problem {problem.id!r} matches no template")


FAMILY = TaskFamily(
    name=NAME,
    description="templated arithmetic word problems (levels 1-4) answered exactly with Python",
    defaults=DEFAULTS,
    make=make,
    solution_code=solution_code,
    check=_check,
)
