"""`rubric_reward(funcs, weights)`: plain reward functions as one reward, as verifiers' rubrics
combine them.

Each function takes any of `prompt`, `completion`, `answer`, `state`, `task`, `info` by keyword
(or `**kwargs`) and returns a float, sync or async; the score is the weighted sum. Here
`completion` is `[{"role": "assistant", "content": rollout.response_text}]` (the whole
response as one message) and `state` is `{"rollout": rollout}`. A function that raises scores
0, is named in the rollout's `reward_errors`, and the others still count.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.records import Problem, RewardResult, Rollout

if TYPE_CHECKING:
    from asyncrl.rollout.runner import RewardFn

__all__ = ["rubric_reward"]


def _accepts(fn: Callable[..., Any]) -> tuple[bool, frozenset[str]]:
    params = inspect.signature(fn).parameters.values()
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    return any_kw, frozenset(p.name for p in params)


def rubric_reward(funcs: Sequence[Callable[..., Any]],
                  weights: Sequence[float] | None = None) -> RewardFn:
    """verifiers-style reward functions as one asyncrl reward: the weighted sum of their
    scores (weights default to 1.0 each). Each function gets, by keyword, those of `prompt`,
    `completion`, `answer`, `state`, `task`, `info` it names (all of them if it takes
    `**kwargs`); sync or async. A function that raises scores 0 and is named in the
    rollout's `reward_errors`; the others still count (as verifiers' own rubrics do)."""
    ws = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(ws) != len(funcs):
        raise ValueError(f"rubric_reward: {len(funcs)} functions but {len(ws)} weights")
    shapes = [_accepts(f) for f in funcs]

    async def reward(problem: Problem, rollout: Rollout) -> RewardResult:
        available = {"prompt": problem.question,
                     "completion": [{"role": "assistant", "content": rollout.response_text}],
                     "answer": problem.answer, "state": {"rollout": rollout},
                     "task": problem.source, "info": {}}
        total = 0.0
        detail: dict[str, float] = {}
        errors: list[str] = []
        for fn, w, (any_kw, names) in zip(funcs, ws, shapes, strict=True):
            kwargs = available if any_kw else {k: v for k, v in available.items() if k in names}
            name = getattr(fn, "__name__", "reward")
            try:
                score = fn(**kwargs)
                if inspect.isawaitable(score):
                    score = await score
                value = float(score)
            except Exception as e:  # one broken function scores 0; the others still count
                errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
                value = 0.0
            detail[name] = value
            total += w * value
        return RewardResult(reward=total, status="ok", detail=detail, errors=errors)

    return reward
