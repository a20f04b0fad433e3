"""The outcome reward of math problems: 1 if the final answer equals the ground truth, else 0.

Owns: where the final answer is read from (`formats.extract_answer`: the last `\\boxed{}`,
inside the last `<answer>` block when there is one), the equivalence check (`verify_answer`:
math-verify, with a plain numeric/fraction fallback), and `MathReward`, the async reward
function the rollout runner calls as `await reward(problem, rollout)`.
Does not own: penalties for tool errors or format (those are RoC's, never the reward's).

Hang safety: math-verify can run for ever on adversarial answers (`9^{9^{9^{9}}}` makes sympy
build a number with ~10^8 digits inside one C call, where no signal handler can interrupt).
So the check runs in a separate process that is killed at a hard deadline: `MathReward` sends
`verify_answer` to a *host* — anything with
`async call_function(target, args, kwargs, timeout_s) -> result` where `result.status` is
`ok` / `error` / `timeout` / `sandbox_failure` and `result.value` the return value; the sandbox
pool's trusted-function hosting (`sandbox.SandboxPool`) is the production host. A timeout
scores 0 with status `reward_timeout`; nothing here uses `signal.alarm`, and the only check run
in-process is the bounded plain-number comparison (`numeric_verdict`: a regex on at most
`_MAX_PLAIN_CHARS` characters, then exact `Fraction` arithmetic), which cannot hang. It
settles equal plain numbers and unequal integers (most answers) without a worker round trip;
a cold math-verify call in a freshly forked worker child costs ~0.2–0.5 s of CPU.

`verify_answer` must stay importable cheaply in the worker (no torch): the host imports this
module by name. A jailed host needs `host_python_paths()` on its path, and preloading
`REWARD_PRELOAD` in its workers saves the ~0.6 s import of math-verify per call.
"""

from __future__ import annotations

import asyncio
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

from asyncrl.formats import extract_answer
from asyncrl.log import get_logger
from asyncrl.records import Problem, RewardResult, Rollout

log = get_logger(__name__)

VERIFY_TARGET = "asyncrl.tasks.rewards.math:verify_answer"
"""What the host runs: `verify_answer(pred, gold) -> bool`."""
REWARD_PRELOAD: tuple[str, ...] = ("math_verify", "asyncrl.tasks.rewards.math")
"""Modules worth preloading in the host's workers (math-verify's import takes ~1 s)."""

_MAX_PLAIN_CHARS = 64


def host_python_paths() -> tuple[str, ...]:
    """Directories a jailed host must put on `sys.path` to import this module (the
    directory holding the `asyncrl` package; an editable install is not in site-packages)."""
    return (str(Path(__file__).resolve().parents[3]),)


class FunctionHost(Protocol):
    """Runs `"module:function"` in another process and kills it at `timeout_s`."""

    async def call_function(self, target: str, args: tuple = (), kwargs: dict | None = None,
                            timeout_s: float = 2.0) -> Any: ...


# ----------------------------------------------------------------------- the worker side
_INT = r"\d{1,3}(?:,\d{3})+|\d+"
_NUMBER = re.compile(rf"^([+-]?)((?:{_INT})(?:\.\d+)?|\.\d+)$")
_SCI = re.compile(r"^([+-]?)(\d+(?:\.\d+)?|\.\d+)[eE]([+-]?\d{1,3})$")
_SLASH = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}\{(\d+)\}|(\d)(\d))$")
_ANY_SPACE = re.compile(r"\s")
_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\$")


def plain_number(text: str) -> Fraction | None:
    """The exact value of a plain number, or None if `text` is anything else.

    Accepted: integers (with optional thousands commas, `1,234,567`, or `{,}`), decimals,
    `a/b`, `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` (also `\\frac12`), a sign, surrounding `$`,
    whitespace and LaTeX spacing, and e-notation with at most three exponent digits
    (`9.36e-18`): the value stays cheap to build whatever the input. Not accepted, so left to
    math-verify: whitespace inside the number (`1 2`, `3 1/2`, `2, 500` are not 12, 31/2 and
    2500) and parentheses (`(2,500)` is a pair, not 2500).
    """
    if len(text) > _MAX_PLAIN_CHARS:
        return None
    s = _NOISE.sub("", text.replace("{,}", ",")).strip().rstrip(".")
    if _ANY_SPACE.search(s) or "(" in s:
        return None
    if m := _NUMBER.match(s):
        value = Fraction(m.group(2).replace(",", ""))
        return -value if m.group(1) == "-" else value
    if m := _SCI.match(s):  # math-verify would read the `e` as Euler's number
        value = Fraction(m.group(2)) * Fraction(10) ** int(m.group(3))
        return -value if m.group(1) == "-" else value
    if m := _SLASH.match(s):
        num, den, sign = int(m.group(2)), int(m.group(3)), m.group(1)
    elif m := _FRAC.match(s):
        sign = m.group(1)
        num = int(m.group(2) if m.group(2) is not None else m.group(4))
        den = int(m.group(3) if m.group(3) is not None else m.group(5))
    else:
        return None
    if den == 0:
        return None
    value = Fraction(num, den)
    return -value if sign == "-" else value


def numeric_verdict(pred: str, gold: str) -> bool | None:
    """A verdict without math-verify when one is certain, else None.

    True when both are plain numbers (see `plain_number`) with the same exact value. When the
    *gold* is in e-notation (a float printed: `9.360000138304076e-18`), True within a
    relative 1e-6, else False; when only the answer is, False (its exact value differs from
    the gold's: `1e6` is not 1000001, nor `5.926413105940000e+08` 592641326.305). False when
    both are plain *integers* that differ (math-verify's rounding tolerance only matters for
    non-integers, which are left to it). None otherwise.
    """
    a, b = plain_number(pred), plain_number(gold)
    if a is None or b is None:
        return None
    if a == b:
        return True
    if _SCI_MARK.search(gold):
        # a float's printing: math-verify would misread it, and its 6-decimal rounding is
        # meaningless at 1e-18; equal to a relative 1e-6 instead
        return abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b))
    if _SCI_MARK.search(pred):  # math-verify would read the `e` as Euler's number
        return False
    if a.denominator == 1 and b.denominator == 1 and _is_integer_text(pred) \
            and _is_integer_text(gold):
        return False
    return None


_SCI_MARK = re.compile(r"\d[eE][+-]?\d")


def _is_integer_text(text: str) -> bool:
    return "." not in text and "/" not in text and "frac" not in text


def _math_verify(pred: str, gold: str) -> bool:
    import logging

    from math_verify import parse, verify

    # Timeouts off: math-verify's own are signal.alarm based; the host's kill is the deadline.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    pred, gold = pred.strip().strip("$"), gold.strip().strip("$")
    gold_parsed = parse(f"$\\boxed{{{gold}}}$", parsing_timeout=None)
    pred_parsed = parse(f"$\\boxed{{{pred}}}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def verify_answer(pred: str, gold: str) -> bool:
    """Whether the extracted answer `pred` is equivalent to the ground truth `gold`.

    Synchronous and possibly slow or hanging on adversarial input: call it through a host with
    a hard timeout (`MathReward` does). Plain numbers and fractions are compared exactly first;
    everything else (LaTeX, expressions, intervals, percentages) goes to math-verify. Both
    arguments are the bare answer, without `\\boxed{}`.
    """
    verdict = numeric_verdict(pred, gold)
    if verdict is not None:
        return verdict
    return _math_verify(pred, gold)


# ------------------------------------------------------------------------ the async side
class MathReward:
    """`await reward(problem, rollout) -> RewardResult`: 1.0 for an equivalent final answer.

    Statuses: `ok` (checked; reward 1 or 0), `no_answer` (no `\\boxed{}` found),
    `reward_timeout` (the check passed `timeout_s` and was killed), `reward_error` (the check
    raised, or the host failed twice). Never raises for a bad answer or a failing host; the
    rollout then scores 0 with the status saying why.
    """

    def __init__(self, host: FunctionHost, *, timeout_s: float = 2.0,
                 target: str = VERIFY_TARGET, retries: int = 1, grace_s: float = 5.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.target = target
        self.retries = retries
        self.grace_s = grace_s
        """Extra time on top of `timeout_s` before we stop waiting for the host itself."""

    async def __call__(self, problem: Problem, rollout: Rollout) -> RewardResult:
        answer = extract_answer(rollout.response_text)
        if answer is None:
            return RewardResult(reward=0.0, status="no_answer")
        verdict = numeric_verdict(answer, problem.answer)
        if verdict is not None:
            # Bounded and exact (integer answers, mostly): no worker round trip needed.
            return RewardResult(reward=float(verdict), status="ok", answer=answer)
        return await self._check(problem, rollout, answer)

    async def _check(self, problem: Problem, rollout: Rollout, answer: str) -> RewardResult:
        detail = ""
        for _ in range(self.retries + 1):
            try:
                async with asyncio.timeout(self.timeout_s + self.grace_s):
                    res = await self.host.call_function(
                        self.target, args=(answer, problem.answer), kwargs=None,
                        timeout_s=self.timeout_s)
            except TimeoutError:
                # The host did not honour its own deadline; treat as the check timing out.
                detail = "host did not answer within its deadline"
                status = "timeout"
            except Exception as e:  # any host failure scores 0; it must never kill a group
                detail = f"{type(e).__name__}: {e}"
                status = "sandbox_failure"
            else:
                status, detail = str(getattr(res.status, "value", res.status)), res.detail
                if status == "ok":
                    return RewardResult(reward=1.0 if res.value else 0.0, status="ok",
                                        answer=answer)
            if status == "timeout":
                log.warning("reward_timeout", rollout_id=rollout.rollout_id,
                            answer_chars=len(answer), timeout_s=self.timeout_s)
                return RewardResult(reward=0.0, status="reward_timeout", answer=answer)
            if status == "error":
                break
        log.warning("reward_error", rollout_id=rollout.rollout_id, detail=detail[-500:])
        return RewardResult(reward=0.0, status="reward_error", answer=answer)
