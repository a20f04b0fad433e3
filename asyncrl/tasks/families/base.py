"""What a task family is: a seeded generator of `Problem`s plus the program that solves each one.

Owns: the `TaskFamily` record the registry holds, the `Form` of a templated question (its
English text, the Python that answers it, and an independent exact computation of the answer),
and validation of a family's options. Does not own: any particular family (see `tiny_math`),
how problems are turned into transcripts (`asyncrl.sft.coldstart`), or how they are read from files.

Everything here is pure: same options and seed, same problems, on every machine (seeds are
strings hashed by `random.Random`, which is stable across processes, unlike `hash()`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrl.records import Problem
from asyncrl.tasks.task import WorkedSolution

Sampler = Callable[[random.Random], dict[str, int]]
"""Draws the numbers of one question (slot name -> value)."""


@dataclass(frozen=True)
class Form:
    """One templated question: `question` and `code` are `str.format` templates over the same
    integer slots; `solve` computes the exact answer from the slots (without running `code`),
    so the two can check each other."""

    key: str
    question: str
    code: str
    solve: Callable[..., int]
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Literal text escaped, each `{slot}` a signed integer group: a question parses back
        # into its numbers, so a `Problem` alone is enough to rebuild its solution program.
        parts = re.split(r"\{(\w+)\}", self.question)
        regex = "".join(
            re.escape(p) if i % 2 == 0 else f"(?P<{p}>-?\\d+)" for i, p in enumerate(parts)
        )
        object.__setattr__(self, "_pattern", re.compile(regex))

    def render(self, slots: Mapping[str, int]) -> tuple[str, str, int]:
        """(question, code, answer) for these numbers."""
        return self.question.format(**slots), self.code.format(**slots), self.solve(**slots)

    def match(self, question: str) -> dict[str, int] | None:
        """The slots of `question` if it is an instance of this form, else None."""
        m = self._pattern.fullmatch(question)
        return None if m is None else {k: int(v) for k, v in m.groupdict().items()}


@dataclass(frozen=True)
class TaskFamily:
    """A registered task family.

    `make(options, seed)` returns (train, eval) with disjoint questions; `options` has already
    been checked by `check_options` and completed with `defaults`. `solution_code(problem)` is
    the problem's worked solution (`asyncrl.tasks.task.SolutionCode`: a short Python program
    whose stdout is the answer, what the SFT transcripts call the tool with, or a
    `WorkedSolution` with its reasoning, or None where the family has none for it); it raises
    `ValueError` for a problem that is not from this family.
    """

    name: str
    description: str
    defaults: Mapping[str, Any]
    make: Callable[[dict[str, Any], int], tuple[list[Problem], list[Problem]]]
    solution_code: Callable[[Problem], str | WorkedSolution | None]
    check: Callable[[dict[str, Any]], None] = lambda opts: None
    """Family-specific value checks (after the type checks); raises ValueError naming the option."""
    reward: Callable[[Any], Any] | None = None
    """The family's own answer check, `reward(ctx) -> async (problem, rollout) -> RewardResult`
    given an `asyncrl.tasks.task.TaskContext` (what `[task] reward = "auto"` uses); None: the
    math reward is right for its answers."""

    def resolve_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with `options`; unknown names and wrongly typed values raise
        `ValueError` naming the option."""
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown option {unknown[0]!r}; known options: "
                f"{', '.join(sorted(self.defaults))}"
            )
        opts = {**self.defaults, **options}
        for key, default in self.defaults.items():
            _check_type(self.name, key, opts[key], default)
        self.check(opts)
        return opts


def _check_type(family: str, key: str, value: Any, default: Any) -> None:
    """`value` must have the default's type (a bool is not an int; list items typed alike)."""

    def same(v: Any, d: Any) -> bool:
        if isinstance(d, bool) or isinstance(v, bool):
            return isinstance(v, bool) and isinstance(d, bool)
        if isinstance(d, float):
            return isinstance(v, (int, float))
        return isinstance(v, type(d))

    if isinstance(default, list):
        ok = isinstance(value, list) and (not default or all(same(v, default[0]) for v in value))
        want = f"a list of {type(default[0]).__name__}" if default else "a list"
    else:
        ok = same(value, default)
        want = type(default).__name__
    if not ok:
        raise ValueError(f"{family}: option {key!r} must be {want}, got {value!r}")


def digits(rng: random.Random, n: int) -> int:
    """A uniformly drawn integer with exactly `n` decimal digits."""
    return rng.randint(10 ** (n - 1), 10**n - 1)


def draw_split(
    split: str,
    family: str,
    n: int,
    levels: list[int],
    variants: Mapping[int, list[tuple[Form, Sampler]]],
    rng: random.Random,
    taken: set[str],
) -> list[Problem]:
    """`n` problems with questions not in `taken` (which grows), levels cycled in order so every
    level gets its share. Raises ValueError when the levels cannot supply that many new
    questions."""
    out: list[Problem] = []
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(1000):
            form, sample = rng.choice(variants[level])
            question, _code, answer = form.render(sample(rng))
            if question not in taken:
                break
        else:
            raise ValueError(
                f"{family}: could not draw {n} distinct {split} questions at level {level}; "
                "ask for fewer problems or more levels"
            )
        taken.add(question)
        out.append(Problem(id=f"{family}-{split}-{i:06d}", question=question, answer=str(answer),
                           source=family, difficulty=float(level)))
    return out
