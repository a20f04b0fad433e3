"""Math reward: answer extraction, equivalence, and hang safety through a function host."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import pytest

from asyncrl.records import Problem, Rollout
from asyncrl.tasks.rewards.math import (
    REWARD_PRELOAD,
    VERIFY_TARGET,
    MathReward,
    host_python_paths,
    numeric_verdict,
    plain_number,
    verify_answer,
)

HANG = "9^{9^{9^{9}}}"   # sympy builds 9**(9**387420489) inside one C call


def rollout(text: str) -> Rollout:
    return Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=0,
                   prompt_ids=[1], response_text=text)


def problem(answer: str) -> Problem:
    return Problem(id="p", question="q", answer=answer)


@pytest.mark.parametrize(("pred", "gold"), [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac12", "1/2"),
    ("-\\frac{3}{4}", "-0.75"),
    ("1,000,000", "1000000"),
    ("12{,}345", "12345"),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt2/2"),
    ("10^{3}", "1000"),
    ("x = 5", "5"),
    ("2", "2.0"),
    ("(1, 2)", "(1,2)"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
])
def test_equivalent_answers(pred, gold):
    assert verify_answer(pred, gold) is True


@pytest.mark.parametrize(("pred", "gold"), [
    ("3", "4"),
    ("1,2", "12"),            # not a thousands separator: a pair, not twelve
    ("\\frac{1}{3}", "0.3"),
    ("\\sqrt{2}", "2"),
    ("", "1"),
    ("1000000", "1000001"),
])
def test_different_answers(pred, gold):
    assert verify_answer(pred, gold) is False


def test_plain_number_fallback():
    assert plain_number("$1,234$") == 1234
    assert plain_number("\\frac{-3}{6}") == Fraction(-1, 2)
    assert plain_number("-\\tfrac{1}{4}") == Fraction(-1, 4)
    assert plain_number(".5") == Fraction(1, 2)
    assert plain_number("1/0") is None
    assert plain_number("1e9999999") is None          # no exponents: stays cheap
    assert plain_number("9" * 100) is None             # length cap
    assert numeric_verdict("1,000", "1000") is True
    assert numeric_verdict("7", "8") is False
    assert numeric_verdict("0.333333", "1/3") is None  # left to math-verify's tolerance
    assert numeric_verdict("x", "1") is None


@pytest.mark.parametrize("pred,gold", [
    ("1 2", "12"), ("3 1/2", "31/2"), ("12 345", "12345"),   # digits apart are not one number
    ("(2,500)", "2500"), ("(1,234)", "1234"), ("2, 500", "2500"),  # a pair or a list
])
def test_the_fast_path_never_joins_numbers_math_verify_keeps_apart(pred, gold):
    assert plain_number(pred) is None
    assert numeric_verdict(pred, gold) is None
    assert verify_answer(pred, gold) is False


def test_the_fast_path_still_reads_spaced_and_latex_numbers():
    assert plain_number(" $ 1,234 $ ") == 1234
    assert plain_number("1\\,000") == 1000
    assert numeric_verdict(" 12 ", "12") is True


# ------------------------------------------------------------------------ MathReward
class FakeHost:
    """Answers call_function from a script of statuses; counts calls."""

    def __init__(self, *outcomes: str, value: object = True, hang: bool = False) -> None:
        self.outcomes = list(outcomes)
        self.value = value
        self.hang = hang
        self.calls: list[tuple] = []

    async def call_function(self, target, args=(), kwargs=None, timeout_s=2.0):
        self.calls.append((target, args, timeout_s))
        if self.hang:
            await asyncio.sleep(3600)
        status = self.outcomes.pop(0) if self.outcomes else "ok"
        if status == "raise":
            raise ConnectionError("worker died")

        class Result:
            pass

        r = Result()
        r.status, r.value, r.detail = status, self.value, "detail"
        return r


async def test_answer_inside_answer_block_is_checked_by_the_host():
    host = FakeHost("ok", value=True)
    text = "<reason>\\boxed{7}</reason><answer>so \\boxed{\\frac{\\pi}{2}}</answer>"
    res = await MathReward(host)(problem("\\pi/2"), rollout(text))
    assert (res.reward, res.status, res.answer) == (1.0, "ok", "\\frac{\\pi}{2}")
    assert host.calls == [(VERIFY_TARGET, ("\\frac{\\pi}{2}", "\\pi/2"), 2.0)]


async def test_plain_numbers_are_settled_without_the_host():
    host = FakeHost()
    right = await MathReward(host)(problem("1000"), rollout("<answer>\\boxed{1,000}</answer>"))
    wrong = await MathReward(host)(problem("1000"), rollout("<answer>\\boxed{999}</answer>"))
    assert (right.reward, right.status) == (1.0, "ok")
    assert (wrong.reward, wrong.status) == (0.0, "ok")
    assert host.calls == []


async def test_no_boxed_answer_scores_zero():
    res = await MathReward(FakeHost())(problem("1"), rollout("<answer>1</answer>"))
    assert (res.reward, res.status, res.answer) == (0.0, "no_answer", None)


@pytest.mark.parametrize(("outcomes", "status", "calls"), [
    (("ok",), "ok", 1),
    (("timeout",), "reward_timeout", 1),
    (("error",), "reward_error", 1),                       # the check raised: no retry
    (("sandbox_failure", "ok"), "ok", 2),                  # transient host failure: retried
    (("sandbox_failure", "sandbox_failure"), "reward_error", 2),
    (("raise", "raise"), "reward_error", 2),               # host raising never escapes
])
async def test_host_outcomes(outcomes, status, calls):
    host = FakeHost(*outcomes, value=False)
    res = await MathReward(host)(problem("x^2"), rollout("\\boxed{x^3}"))
    assert res.status == status and res.reward == 0.0
    assert len(host.calls) == calls


async def test_host_that_never_answers_times_out():
    t0 = time.monotonic()
    res = await MathReward(FakeHost(hang=True), timeout_s=0.2, grace_s=0.3)(
        problem("x^2"), rollout("\\boxed{x^3}"))
    assert (res.reward, res.status) == (0.0, "reward_timeout")
    assert time.monotonic() - t0 < 2.0


# ------------------------------------------------------------------- the real sandbox pool
@pytest.fixture
async def pool():
    sandbox = pytest.importorskip("sandbox")
    from sandbox.config import DEFAULT_PRELOAD

    cfg = sandbox.PoolConfig(workers=1, preload=DEFAULT_PRELOAD + REWARD_PRELOAD,
                             python_paths=host_python_paths())
    async with sandbox.SandboxPool(cfg) as p:
        yield p


@pytest.mark.timeout(120)
async def test_pathological_answer_scores_zero_within_the_timeout_in_the_sandbox_pool(pool):
    reward = MathReward(pool, timeout_s=2.0)
    t0 = time.monotonic()
    res = await reward(problem("1"), rollout(f"<answer>\\boxed{{{HANG}}}</answer>"))
    elapsed = time.monotonic() - t0
    assert (res.reward, res.status) == (0.0, "reward_timeout")
    assert elapsed < 2.0 + 3.0
    # the pool is still serving: a LaTeX equivalence goes through the worker and scores 1
    ok = await reward(problem("\\sqrt{2}/2"), rollout("<answer>\\boxed{\\frac{\\sqrt2}{2}}</answer>"))
    assert (ok.reward, ok.status) == (1.0, "ok")
    bad = await reward(problem("\\sqrt{2}"), rollout("<answer>\\boxed{\\sqrt{3}}</answer>"))
    assert (bad.reward, bad.status) == (0.0, "ok")
