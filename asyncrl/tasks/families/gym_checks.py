"""Answer checks for reasoning-gym problems, right for each generator's answer format.

Owns `check(generator, pred, gold) -> bool | None` (None: this module has no rule for the
generator) and `GymReward`, the `reasoning_gym` family's reward: the rule below when there is
one, else the math reward (`asyncrl.tasks.rewards.math.MathReward`) for generators whose answers are
numbers or expressions math-verify reads right, else reasoning-gym's own `score_answer`,
guarded.

Why not reasoning-gym's `score_answer` everywhere (measured in
shared/research/environment-packages-2026-11-27.md, section 3): it gives partial credit
(`len(gold)/len(answer)` when the gold is a substring: `627` for `62` scores 0.33), full
credit to a negated `gsm_symbolic` answer, 1.0 to a hexadecimal question answered in decimal,
and raises on LaTeX (`prime_factorization`). Why not math-verify everywhere: it reads
`9.36e-18` as `9.36*e - 18`, rounds floats to 6 decimals (`0.456647` "equals" `79/173`), and
evaluates products (`866` "equals" `2 × 433`).

Rules:
- `integer`: both exact integers (thousands separators allowed), equal. No partial credit;
  the sign counts. `decimal` (`gsm_symbolic`): the same for plain decimals (`1606.5`).
- Whitespace inside a number makes it no number (`1 2` is not 12, `2 3` not 23), and
  `\\text{...}` keeps its contents.
- `significant`: `power_function` asks for 3 significant figures (e-notation): both read as
  decimals (`9.36e-18`, `9.36 \\times 10^{-18}`), equal when rounded to 3 significant figures.
- `same_float`: `number_format` (pick a candidate written with commas or in e-notation): the
  answer's exact value equal to the gold's within a float's printing noise (1e-12 relative).
- `lowest_terms`: `fraction_simplification`: `a/b` or `\\frac{a}{b}` with gcd(a, b) = 1 and
  the gold's value.
- `prime_factors`: `prime_factorization`: factors separated by ×, *, x or `\\times` (a power
  `p^k` counts k times), all prime, the same multiset as the gold's.
- reasoning-gym's `score_answer` (other generators), by the dataset built with the run's
  `generator_config` (kept, never rebuilt per call; run on a worker thread): credit only at
  1.0, an exception scores 0 (status `reward_error`), and `bitwise_arithmetic`'s answer must
  keep the gold's base.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections import Counter
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from math import gcd
from typing import Any

from asyncrl.formats import extract_answer
from asyncrl.records import Problem, RewardResult, Rollout
from asyncrl.tasks.rewards.math import plain_number

INTEGER = frozenset({"basic_arithmetic", "chain_sum", "products", "simple_equations",
                     "gcd", "lcm", "count_bits", "leg_counting"})
"""Generators with integer answers (checked exactly: `rg.score_answer` part-credits wrong
ones)."""
DECIMAL = frozenset({"gsm_symbolic"})
"""Generators whose answers are plain decimals, mostly integers (checked exactly:
`rg.score_answer` credits a negated `gsm_symbolic` answer; about 1 item in 450 has a decimal
gold such as `1606.5`, which an integer rule could never credit)."""
MATH = frozenset({"polynomial_equations", "complex_arithmetic", "decimal_chain_sum"})
"""Generators math-verify scores right (checked in the killable host)."""

ENTRIES: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {}
"""reasoning-gym's own item (answer and metadata) and the dataset that drew it, by (generator,
question), for its `score_answer`: some generators score from the metadata, and some read the
dataset's config (`decimal_arithmetic`'s tolerance, `puzzle24`'s range, `time_intervals`'
scale, `polynomial_equations`' penalties), so an item is scored by the dataset built with the
run's `generator_config`. Filled by `asyncrl.tasks.families.rgym` (`remember`) as problems are
drawn."""


def remember(generator: str, question: str, entry: dict[str, Any], dataset: Any) -> None:
    """Keep `entry` and the `dataset` (built with the run's config) that drew it."""
    ENTRIES[(generator, question)] = (dict(entry), dataset)


@functools.cache
def _default_dataset(generator: str) -> Any:
    """A dataset with reasoning-gym's default config, built once: for problems read from a
    file, whose drawing dataset this process never built."""
    import reasoning_gym

    return reasoning_gym.create_dataset(generator, seed=0, size=1)

_MAX_CHARS = 200
_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\$")
_TEXT = re.compile(r"\\text\{([^}]*)\}")
_SPLIT_NUMBER = re.compile(r"[\d.,]\s+[\d.,]")
"""Whitespace inside a number: `1 2` is not 12, nor `2 3` the prime 23."""
_INT = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)$")
_PLAIN_DECIMAL = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")
_TIMES10 = re.compile(r"^([+-]?\d+(?:\.\d+)?)(?:\\times|\\cdot|\*|×)10\^\{?([+-]?\d{1,3})\}?$")
_SLASH = re.compile(r"^([+-]?\d+)/(\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{(\d+)\}$")
_FACTOR_SEP = re.compile(r"\\times|\\cdot|[×*x·]")


def _clean(text: str) -> str:
    """`text` without LaTeX spacing, `\\left`/`\\right`, `$` and whitespace; `\\text{...}` keeps
    its contents (`1\\text{ or }2` is not 12). Whitespace inside a number is kept, so no rule
    reads it as one number (as `asyncrl.tasks.rewards.math.plain_number`)."""
    s = _TEXT.sub(r"\1", _NOISE.sub("", text)).strip().rstrip(".")
    return s if _SPLIT_NUMBER.search(s) else "".join(s.split())


def _exact_decimal(text: str) -> Decimal | None:
    s = _clean(text)
    if len(s) > _MAX_CHARS or not _PLAIN_DECIMAL.match(s):
        return None
    return Decimal(s.replace(",", ""))


def _integer(text: str) -> int | None:
    s = _clean(text)
    return int(s.replace(",", "")) if len(s) <= _MAX_CHARS and _INT.match(s) else None


def _decimal(text: str) -> Decimal | None:
    s = _clean(text)
    if len(s) > _MAX_CHARS:
        return None
    if m := _TIMES10.match(s):
        return Decimal(m.group(1)).scaleb(int(m.group(2)))
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d{1,3})?", s, re.I) is None:
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _same_float(pred: str, gold: str) -> bool:
    """`number_format`: the answer is the candidate whose value is the gold's. Candidates are
    printed with commas, trailing zeros or in e-notation from a float (`5.926413263049999e+08`
    for 592641326.305), and differ from each other from about the 8th significant digit: equal
    within a relative 1e-12 (a float's printing noise), never a rounding of the gold."""
    a, b = plain_number(_clean(pred)), plain_number(_clean(gold))
    return a is not None and b is not None and abs(a - b) <= Fraction(1, 10**12) * abs(b)


def _sig3(x: Decimal) -> Decimal:
    return x if x == 0 else Decimal(f"{x:.2e}")


def _fraction(text: str) -> tuple[int, int] | None:
    s = _clean(text)
    if len(s) > _MAX_CHARS:
        return None
    if m := _SLASH.match(s):
        return int(m.group(1)), int(m.group(2))
    if m := _FRAC.match(s):
        num = int(m.group(2))
        return (-num if m.group(1) == "-" else num), int(m.group(3))
    return None


def _factors(text: str) -> Counter[int] | None:
    s = _clean(text)
    if not s or len(s) > _MAX_CHARS:
        return None
    out: Counter[int] = Counter()
    for part in _FACTOR_SEP.split(s):
        m = re.fullmatch(r"(\d{1,12})(?:\^\{?(\d{1,2})\}?)?", part)
        if m is None:
            return None
        out[int(m.group(1))] += int(m.group(2) or 1)
    return out


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def check(generator: str, pred: str, gold: str) -> bool | None:
    """Whether `pred` (the extracted answer) is right for `gold`, by the generator's rule;
    None when this module has no rule for `generator`. Bounded: no input makes it slow."""
    if generator in INTEGER:
        a, b = _integer(pred), _integer(gold)
        return a is not None and a == b
    if generator == "number_format":
        return _same_float(pred, gold)
    if generator in DECIMAL:
        x, y = _exact_decimal(pred), _exact_decimal(gold)
        return x is not None and x == y
    if generator == "power_function":
        x, y = _decimal(pred), _decimal(gold)
        return x is not None and y is not None and _sig3(x) == _sig3(y)
    if generator == "fraction_simplification":
        p, g = _fraction(pred), _fraction(gold)
        return (p is not None and g is not None and p[1] != 0 and gcd(*p) == 1
                and Fraction(*p) == Fraction(*g))
    if generator == "prime_factorization":
        f, g_f = _factors(pred), _factors(gold.replace(" ", ""))
        return f is not None and f == g_f and all(_is_prime(p) for p in f)
    return None


def rg_score(generator: str, pred: str, entry: dict[str, Any], dataset: Any = None) -> bool:
    """reasoning-gym's own `score_answer` on its item `entry` (answer and metadata), by the
    `dataset` that drew it (None: one with the default config), guarded: credit only at 1.0,
    and a bitwise answer must be written in the gold's base. Raises what the scorer raises."""
    ds = dataset if dataset is not None else _default_dataset(generator)
    gold = str(entry.get("answer", ""))
    if generator == "bitwise_arithmetic" and gold.lstrip("-").startswith("0x") and \
            not pred.strip().lstrip("-").lower().startswith("0x"):
        return False
    return float(ds.score_answer(pred, entry)) >= 1.0


class GymReward:
    """The `reasoning_gym` family's reward: `await reward(problem, rollout)`."""

    def __init__(self, host: Any) -> None:
        from asyncrl.tasks.rewards.math import MathReward

        self.math = MathReward(host) if host is not None else None

    async def __call__(self, problem: Problem, rollout: Rollout) -> RewardResult:
        generator = problem.source.split("/", 1)[-1]
        answer = extract_answer(rollout.response_text)
        if answer is None:
            return RewardResult(reward=0.0, status="no_answer")
        verdict = check(generator, answer, problem.answer)
        if verdict is None and generator in MATH and self.math is not None:
            return await self.math(problem, rollout)
        if verdict is None:
            try:
                entry, ds = ENTRIES.get((generator, problem.question),
                                        ({"answer": problem.answer, "metadata": {}}, None))
                # off the event loop: some scorers take a tenth of a second or more
                verdict = await asyncio.to_thread(rg_score, generator, answer, entry, ds)
            except Exception as e:  # reasoning-gym's scorer raises on forms it cannot read
                return RewardResult(reward=0.0, status="reward_error", answer=answer,
                                    errors=[f"score_answer: {type(e).__name__}: {e}"[:300]])
        return RewardResult(reward=float(verdict), status="ok", answer=answer)
