"""The embedding default reward: the last `\\boxed{}` equal to the answer after normalising.

Owns `normalize_answer` and `exact_match_reward` (re-exported by `asyncrl.api`; named
`exact_match` in `[task] reward`). Does not own the math reward (`asyncrl.tasks.rewards.math`).
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from asyncrl import formats
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.tasks.rewards.math import plain_number

_DIGIT_GAP = re.compile(r"(?<=\d)\s+(?=\d)")
_SPACE = re.compile(r"(?<!\d)\s+|\s+(?!\d)")
_DECIMAL = re.compile(r"^[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?$")


def normalize_answer(text: str) -> str:
    """Whitespace, `$`, a trailing period and `\\text{}`/`\\left`/`\\right` removed; a number
    becomes its exact value, so `3.0`, `3`, `1,000`/`1000`, `1e3`/`1000` and `0.5`/`1/2`
    compare equal, while integers past 2^53 that differ by one do not. A comma counts only as
    a clean thousands grouping (`2,3` is not `23`), and whitespace between two digits is kept
    (`1 2` is not `12`)."""
    t = text.strip().strip("$").rstrip(".")
    t = re.sub(r"\\text\{([^}]*)\}", r"\1", t)
    t = t.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    t = _DIGIT_GAP.sub(" ", t.strip())
    t = _SPACE.sub("", t)
    value = _exact_number(t)
    return t if value is None else str(value)


def _exact_number(t: str) -> Fraction | None:
    """The exact value of a decimal (thousands commas and an exponent allowed) or of what
    `reward.plain_number` reads (`a/b`, `\\frac`); None for anything else."""
    if _DECIMAL.match(t):
        return Fraction(Decimal(t.replace(",", "")))
    return plain_number(t)


async def exact_match_reward(problem: Problem, rollout: Rollout) -> RewardResult:
    """1.0 when the rollout's final answer (`formats.extract_answer`: the last `\\boxed{}`)
    equals the problem's answer after `normalize_answer`, else 0.0; status `no_answer` when
    there is none."""
    answer = formats.extract_answer(rollout.response_text)
    if answer is None:
        return RewardResult(reward=0.0, status="no_answer", answer=None)
    ok = normalize_answer(answer) == normalize_answer(problem.answer)
    return RewardResult(reward=1.0 if ok else 0.0, status="ok", answer=answer)
