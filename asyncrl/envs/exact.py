"""The embedding default reward: the last `\\boxed{}` equal to the answer after normalising.

Owns `normalize_answer` and `exact_match_reward` (re-exported by `asyncrl.api`; named
`exact_match` in `[task] reward`). Does not own the math reward (`asyncrl.reward`).
"""

from __future__ import annotations

import re

from asyncrl import formats
from asyncrl.records import Problem, RewardResult, Rollout

_SPACE = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Whitespace, `$`, a trailing period and `\\text{}`/`\\left`/`\\right` removed; numbers
    like `3.0` and `3` compare equal."""
    t = text.strip().strip("$").rstrip(".")
    t = re.sub(r"\\text\{([^}]*)\}", r"\1", t)
    t = t.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    t = _SPACE.sub("", t)
    try:
        f = float(t.replace(",", ""))
        return str(int(f)) if f.is_integer() else repr(f)
    except ValueError:
        return t


async def exact_match_reward(problem: Problem, rollout: Rollout) -> RewardResult:
    """1.0 when the rollout's final answer (`formats.extract_answer`: the last `\\boxed{}`)
    equals the problem's answer after `normalize_answer`, else 0.0; status `no_answer` when
    there is none."""
    answer = formats.extract_answer(rollout.response_text)
    if answer is None:
        return RewardResult(reward=0.0, status="no_answer", answer=None)
    ok = normalize_answer(answer) == normalize_answer(problem.answer)
    return RewardResult(reward=1.0 if ok else 0.0, status="ok", answer=answer)
