"""The embedding API: run agentic rollouts from another project.

Owns: the short path from "prompts, an engine, some tools, a reward" to a stream of rewarded
groups (`rollout_groups`), a trivial exact-match reward for examples and tests
(`exact_match_reward`), and `run_loop` (uvloop when installed). Does not own: any of the
machinery (`asyncrl.rollout`, `asyncrl.engine`); this module only wires it. The math reward
with `math-verify` lives in `asyncrl.reward`.

    from asyncrl import FunctionTool, rollout_groups, run_loop
    async for group in rollout_groups(problems, engines=[engine], tokenizer=tok, tools=[...]):
        ...

See docs/embedding.md for a complete example.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from asyncrl import formats
from asyncrl.engine.base import Engine
from asyncrl.records import Group, Problem, RewardResult, Rollout
from asyncrl.rollout.agent import RolloutSettings
from asyncrl.rollout.eventloop import run as run_loop
from asyncrl.rollout.runner import RewardFn, RolloutRunner
from asyncrl.rollout.tools import Tool

__all__ = ["exact_match_reward", "normalize_answer", "rollout_groups", "run_loop"]

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
    """1.0 when the rollout's final answer (`formats.extract_answer`) equals the problem's
    answer after `normalize_answer`, else 0.0; status `no_answer` when there is none."""
    answer = formats.extract_answer(rollout.response_text)
    if answer is None:
        return RewardResult(reward=0.0, status="no_answer", answer=None)
    ok = normalize_answer(answer) == normalize_answer(problem.answer)
    return RewardResult(reward=1.0 if ok else 0.0, status="ok", answer=answer)


async def rollout_groups(problems: Sequence[Problem], *, engines: Sequence[Engine],
                         tokenizer: Any, tools: Sequence[Tool] = (),
                         reward_fn: RewardFn = exact_match_reward, samples_per_prompt: int = 2,
                         settings: RolloutSettings | None = None, policy: str = "kv",
                         policy_version: int = 0) -> AsyncIterator[Group]:
    """Rollouts for `problems` on `engines`, streamed as rewarded groups as each completes.

    `settings` defaults to `RolloutSettings()` with the tokenizer's EOS id as stop token.
    A thin wrapper over `RolloutRunner(...).run(...)`.
    """
    if settings is None:
        eos = tokenizer.eos_token_id
        settings = RolloutSettings(stop_token_ids=() if eos is None else (int(eos),))
    runner = RolloutRunner(engines, tokenizer, tools, reward_fn, policy=policy)
    async for group in runner.run(problems, samples_per_prompt, settings, policy_version):
        yield group
