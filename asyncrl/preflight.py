"""Checks of a run config that its schema cannot make, run before anything starts.

Owns: the checks that need a task family or a budget rule beside the config. A built-in task
family's `data.generator_options` (names and values, through the family's own
`resolve_options`), and whether one rollout can fit the in-process engine's KV budget (the
rule `asyncrl.policy.check_budget` applies to the embedding API). A failure is a
`ConfigError` naming the key. `asyncrl config check`, `asyncrl train --dry-run` and
`asyncrl train` call `check_run` (the first two through `asyncrl.cli.plan.dry_run`).

Does not own: the schema's own checks (`asyncrl.config`), paths that may be missing on this
machine (`dry_run` reports those), or a remote engine's capacity, which is known only when it
answers (`asyncrl.api` and the engines check that).
"""

from __future__ import annotations

import difflib
import re

from asyncrl.config import RunConfig
from asyncrl.errors import BudgetError, ConfigError


def check_run(cfg: RunConfig) -> None:
    """Raise `ConfigError` naming the key for a generator option or a budget that cannot work."""
    check_generator_options(cfg)
    check_kv_budget(cfg)


def check_generator_options(cfg: RunConfig) -> None:
    """`data.generator_options` as the `generator:` family of `data.train` / `data.eval` reads
    them: an unknown name (with the close one) or a bad value names its key."""
    from asyncrl.data import GENERATOR_PREFIX
    from asyncrl.tasks import TASK_FAMILIES, get_family

    d = cfg.data
    for src in (d.train, d.eval):
        if not src or not src.startswith(GENERATOR_PREFIX):
            continue
        name = src[len(GENERATOR_PREFIX):]
        if name not in TASK_FAMILIES:
            continue  # a plugin source, or a typo: `envs.wiring.check_task` names it, with a hint
        family = get_family(name)
        unknown = sorted(set(d.generator_options) - set(family.defaults))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(family.defaults), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"data.generator_options.{unknown[0]}",
                              f"not an option of {family.name}{hint} (known: "
                              f"{', '.join(sorted(family.defaults))})")
        try:
            family.resolve_options(d.generator_options)
        except ValueError as e:
            named = re.search(r"option '(\w+)'", str(e))
            where = f".{named.group(1)}" if named else ""
            raise ConfigError(f"data.generator_options{where}", str(e)) from None


def rollout_budgets(cfg: RunConfig) -> dict[str, int]:
    """The response budget of every place the run samples rollouts, by where it is set: each
    non-SFT stage's and, when the run evaluates, the evaluation's (`eval.max_response_tokens`,
    else the stage's). SFT stages sample nothing themselves; their evaluations are counted."""
    from asyncrl.stages import stage_budget

    out: dict[str, int] = {}
    for i, st in enumerate(cfg.stages):
        budget = stage_budget(cfg.rollout, st)
        if st.kind != "sft":
            key = (f"stages[{i}].max_response_tokens" if st.max_response_tokens
                   else "rollout.max_response_tokens")
            out[key] = max(out.get(key, 0), budget)
        if cfg.data.eval:
            key = ("eval.max_response_tokens" if cfg.eval.max_response_tokens else
                   f"stages[{i}].max_response_tokens" if st.max_response_tokens else
                   "rollout.max_response_tokens")
            out[key] = max(out.get(key, 0), cfg.eval.max_response_tokens or budget)
    return out


def check_kv_budget(cfg: RunConfig) -> None:
    """One rollout, a prompt of `data.max_prompt_tokens` plus the largest response budget,
    must fit the local engine's `kv_token_budget`: a request that cannot is refused by the
    engine, and a run whose every rollout is refused learns nothing."""
    from asyncrl.policy import check_budget

    capacity = getattr(cfg.engine, "kv_token_budget", None)
    budgets = rollout_budgets(cfg)
    if capacity is None or not budgets:
        return
    where, budget = max(budgets.items(), key=lambda kv: kv[1])
    try:
        check_budget(capacity, budget, cfg.data.max_prompt_tokens, f"{cfg.engine.kind}")
    except BudgetError as e:
        raise ConfigError("engine.kv_token_budget",
                          f"{e} (the response budget is {where}; the prompt's is "
                          "data.max_prompt_tokens)") from None
