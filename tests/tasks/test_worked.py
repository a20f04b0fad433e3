"""Worked solutions made from reasoning-gym's word problems (`asyncrl.tasks.families.worked`):
every program kept prints the gold answer when run by a real Python, later steps name earlier
results, and what cannot be trusted (a broken cot line, a number from nowhere) is left out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.tasks.families import generate, solution_code, worked
from asyncrl.tasks.task import WorkedSolution

reasoning_gym = pytest.importorskip("reasoning_gym")

N = 120


def _printed(programs: list[str]) -> list[str]:
    """What each program prints, run one after another by a fresh Python (full builtins)."""
    runner = ("import contextlib, io, json, sys\n"
              "out = []\n"
              "for code in json.load(sys.stdin):\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n"
              "        exec(code, {})\n"
              "    out.append(buf.getvalue())\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", runner], input=json.dumps(programs),
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("generator", "least"), [("gsm_symbolic", 0.75),
                                                   ("simple_equations", 0.99)])
def test_every_program_of_the_first_problems_prints_the_gold_answer(generator: str,
                                                                     least: float) -> None:
    train, _ = generate("reasoning_gym", {"generators": [generator], "train_size": N,
                                          "eval_size": 8}, 0)
    solved = [(p, solution_code(p)) for p in train]
    kept = [(p, s) for p, s in solved if s is not None]
    assert all(isinstance(s, WorkedSolution) for _, s in kept)
    if generator == "gsm_symbolic":  # each step's words sit above its line, as a comment
        assert all(s.program.startswith("# ") and not s.reasoning for _, s in kept)
    printed = _printed([s.program for _, s in kept])
    assert [out.strip() for out in printed] == [p.answer for p, _ in kept]
    # the rest are counted as missing: most problems have one
    assert len(kept) >= least * N, f"{len(kept)} of {N} have a worked solution"


def test_later_steps_name_earlier_results() -> None:
    cot = ("1. Initial amounts:\n"
           "   • He has 3 times as many kiwi, so 35 × 3 = 105 kiwi\n"
           "   • Total initial items: 105 + 35 = 140\n"
           "2. Bought at store:\n"
           "   • For kiwi, bought 38 fewer than the 93 apple, so 93 - 38 = 55 kiwi\n"
           "   • Total kiwi: 105 + 55 = 160\n"
           "   • Total apple: 35 + 93 = 128\n"
           "   • Combined total: 160 + 128 = 288\n"
           "#### 288")
    question = ("At John's house, there is 3 times as much kiwi as apple. He has a total of 35 "
                "apple in his house. At the store, John bought 93 apple. He also bought some "
                "kiwi, but he bought 38 fewer kiwi than the 93 apple he just bought. What is "
                "the combined total of kiwi and apple?")
    sol = worked.gsm_solution(question, cot, "288")
    assert sol is not None
    said = sol.program.splitlines()
    assert said[:2] == ["# He has 3 times as many kiwi", "kiwi = 35 * 3"]
    lines = [line for line in said if not line.startswith("#")]
    assert lines[-1].startswith("print(round(")
    assert not any("140" in line for line in lines)  # a step the answer does not use is left out
    assert not any(n in sol.program for n in ("105", "55", "160", "128"))  # results are names
    assert worked.run_trusted(sol.program) == "288\n"


def test_a_broken_cot_line_is_skipped() -> None:
    question = "Tom has 5 apples and buys 3 more. Then he eats 2. How many apples are left?"
    cot = ("Tom has 5=5 apples\n"                     # no arithmetic: skipped
           "After buying he has 5 + 3 = 9 apples\n"   # not what it says: skipped
           "After buying he has 5 + 3 = 8 apples\n"
           "He eats 2, so 8 - 2 = 6 apples are left\n"
           "#### 6")
    steps, refused = worked.parse_steps(cot)
    assert refused == 2 and [s.shown.text for s in steps] == ["8", "6"]
    sol = worked.gsm_solution(question, cot, "6")
    assert sol is not None
    first, second, _ = [ln for ln in sol.program.splitlines() if not ln.startswith("#")]
    assert first == "apples = 5 + 3" and second.endswith("= apples - 2")


def test_a_program_with_a_number_from_nowhere_is_not_kept() -> None:
    # the question says 36 of 72 were dropped; the cot multiplies by 0.5, which it never states,
    # and `48=48` leaves 48 with no step to come from
    question = ("Robert has a bag of pebbles with 72 inside. He dropped 36 of them and found "
                "17. How many does he have?")
    cot = ("Robert was left with 72*0.5=36 pebbles.\n"
           "He found some, getting him back to 36+17=53 pebbles.\n#### 53")
    assert worked.gsm_solution(question, cot, "53") is None
    emails = ("James gets 160 emails a day. 30% of those emails don't require any response. "
              "How many does he respond to in a 5 day work week?")
    cot = ("James receives 48=48 emails that don't require a response\n"
           "So James responds to 160-48=112 emails per day\n"
           "In a 5 day work week, James responds to 112*5=560 emails\n#### 560")
    assert worked.gsm_solution(emails, cot, "560") is None
    assert worked.gsm_solution(emails, cot.replace("48=48", "160*30%=48"), "560") is not None


def test_a_linear_equation_is_solved_by_its_program() -> None:
    sol = worked.equation_solution("Solve for e: 56 - 98*e = -1218", "13")
    assert sol is not None and "def gap(e):" in sol.program
    assert worked.run_trusted(sol.program) == "13\n"
    assert worked.equation_solution("Solve for e: 56 - 98*e = -1218", "14") is None
    assert worked.equation_solution("Determine the value of i that satisfies: 0 = 0",
                                    "83") is None
