"""Trials `config check` and the dry run make of a task's own code, so a reward or an
environment that fails on every call fails there, naming its key, and not minutes into a run.

Owns `trial_reward` (one call of a plugin reward function on the first training problem, with
its gold answer as the response) and `trial_env` (the source's `probe`: a text environment
built, and closed, for its first training problem). Each runs on a daemon thread under a
deadline, so a hung call is reported, not waited on. Does not own: what the reward or
environment is (`wiring`, `bridges.textenv`), nor the checks of names and options (`check`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.records import Problem, Rollout
from asyncrl.tasks.task import TaskSource
from asyncrl.tasks.wiring import _one_param, as_reward

TRIAL_S = 30.0
"""How long one trial may take before it is reported as hung."""


def _run(fn: Callable[[], Any], key: str, what: str) -> Any:
    """`fn()` on a daemon thread; its result, or `ConfigError(key, ...)` when it raised or
    did not return within `TRIAL_S`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # the user's code: reported, whatever it raised
            box["err"] = e

    t = threading.Thread(target=target, name=f"asyncrl-trial-{what}", daemon=True)
    t.start()
    t.join(TRIAL_S)
    if t.is_alive():
        raise ConfigError(key, f"{what} did not return within {TRIAL_S:.0f}s on a trial call")
    if "err" in box:
        e = box["err"]
        raise ConfigError(key, f"{what} raised on a trial call: {type(e).__name__}: {e}")
    return box.get("out")


def trial_reward(spec: str, fn: Any, problem: Problem) -> str:
    """Call plugin reward `fn` (named `spec`) once on `problem`, the response being its gold
    answer; a plan line saying what it gave. A factory `(ctx) -> reward` is not called: what
    it needs (the tokenizer, the sandbox) exists only in a run."""
    if _one_param(fn):
        return f"reward {spec}: a factory, built in the run (not tried here)"
    answer = f"<answer>\\boxed{{{problem.answer}}}</answer>"
    ro = Rollout(rollout_id="trial", prompt_id=problem.id, group_id="trial", policy_version=0,
                 prompt_ids=[], response_text=answer)
    reward = as_reward(fn, spec)

    async def once() -> Any:
        return await reward(problem, ro)

    out = _run(lambda: asyncio.run(once()), "task.reward", f"reward {spec!r}")
    return f"reward {spec}: {out.reward:g} for the first problem's gold answer (trial call)"


def trial_env(source: TaskSource) -> str | None:
    """Run the source's `probe` (a text environment built and closed for its first training
    problem); a plan line, or None when the source has none."""
    if source.probe is None:
        return None
    _run(source.probe, "data.train", f"environment of {source.name}")
    return f"text environment {source.name}: one built and closed for the first problem (trial)"
