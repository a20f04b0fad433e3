"""The runs of the RoC ablation (`bench/roc_ablation.py`): the four arms, the split of a
curriculum into the SFT stages run once per seed and the RL stages run once per arm, and what is
read back from a finished run's `metrics.jsonl`.

An arm differs from the others only in its selection rule (`ARMS`, as `--set` overrides):

- `roc-weighted`: RoC, positives drawn with weight 1 / (p_total + 0.1) (the paper);
- `roc-lowest`: RoC, the positives with the lowest p_total (the released code);
- `grpo-first`: plain GRPO on the first G of the 2G samples;
- `grpo-all`: plain GRPO on all 2G samples.

It launches nothing (the script runs the trainings); the statistics over seeds are
`ablation_report`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from statistics import fmean
from typing import Any

from asyncrl.analysis.paired_eval import compare, read_groups
from asyncrl.config import apply_overrides
from asyncrl.errors import ConfigError, DataError
from asyncrl.log import get_logger
from asyncrl.observe.report import load_metrics, run_clock, sampled_key

log = get_logger(__name__)

ARMS: dict[str, list[str]] = {
    "roc-weighted": ["roc.kind=roc", "roc.positive=weighted"],
    "roc-lowest": ["roc.kind=roc", "roc.positive=lowest"],
    "grpo-first": ["roc.kind=grpo_first"],
    "grpo-all": ["roc.kind=grpo_all"],
}


def toml_value(v: Any) -> str:
    """`v` as a TOML inline value (what `--set key=VALUE` parses)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def split_stages(curriculum: Path, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """(SFT stages, RL stages) of the curriculum after `overrides`; a `ConfigError` when it has
    not both."""
    data = apply_overrides(tomllib.loads(curriculum.read_text()), overrides)
    stages = data.get("stages", [])
    sft = [s for s in stages if s.get("kind") == "sft"]
    rl = [s for s in stages if s.get("kind", "rl") != "sft"]
    if not sft or not rl:
        raise ConfigError("stages", f"{curriculum}: the ablation needs SFT and RL stages "
                                    f"(found {len(sft)} and {len(rl)})")
    return sft, rl


def _rows(run_dir: Path) -> list[dict]:
    """A run's `metrics.jsonl` rows, as its report reads them: a resumed run's history without
    the rows a crashed attempt wrote after its last checkpoint (those steps were redone)."""
    return load_metrics(run_dir / "metrics.jsonl")


def tool_error_ratio(steps: list[dict], prefix: str) -> float:
    """Failed calls / calls over `steps` (weighted by each step's calls, not a mean of ratios)."""
    if prefix == "pos":
        calls = sum(r.get("rollout/tool_calls_pos", 0.0) for r in steps)
        errors = sum(r.get("rollout/tool_errors_pos", 0.0) for r in steps)
    else:
        per = [(r.get("rollout/tool_calls_mean", 0.0) * r.get("rollout/count", 0.0),
                r.get("rollout/tool_error_ratio", 0.0)) for r in steps]
        calls = sum(c for c, _ in per)
        errors = sum(c * e for c, e in per)
    return errors / calls if calls else 0.0


EVAL_KEYS = ("eval/accuracy", "eval/avg@", "eval/maj@", "eval/pass@", "eval/tool_error_ratio",
             "eval/response_tokens_mean")


def eval_figures(row: dict) -> dict[str, Any]:
    """An eval row's figures without the `eval/` prefix: greedy accuracy (`accuracy`), the
    sampled avg@k / maj@k / pass@k (per level too), and the tool-error ratios (of all calls and
    of the calls in correct sampled answers: `tool_error_ratio_correct`)."""
    return {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith(EVAL_KEYS)}


def sampled_eval_dir(run_dir: Path, k: int) -> Path:
    """Where `bench/roc_ablation.py --eval-k K` evaluates a run's `final/` apart from its
    training (`asyncrl eval --k K --no-greedy`: its `eval.json` and, while it runs, journal)."""
    return run_dir / f"eval-k{k}"


def paired_by_problem(runs: dict[str, dict[int, Path]], k: int
                      ) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Each RoC arm against each GRPO arm, per seed where both finished their `--eval-k K`
    evaluation: the two compared problem by problem (`asyncrl.analysis.paired_eval.compare`,
    GRPO as A, RoC as B: avg@K of each, RoC - GRPO with its bootstrap interval over the
    problems, the failed calls inside correct answers; over all and per source). `runs` maps
    arm -> seed -> run directory. Two arms of one seed answer the same held-out problems, so
    this tells apart differences a two-seed mean cannot. A seed whose two files do not pair
    (two different held-out sets, a damaged file) is left out with a warning."""
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for roc in (a for a in runs if a.startswith("roc")):
        for grpo in (a for a in runs if a.startswith("grpo")):
            by_seed = {}
            for seed in sorted(set(runs[roc]) & set(runs[grpo])):
                files = [sampled_eval_dir(runs[arm][seed], k) / "eval_groups.jsonl"
                         for arm in (grpo, roc)]
                if not all(f.exists() for f in files):
                    continue
                try:
                    by_seed[seed] = compare(*(read_groups(f) for f in files))
                except ValueError as e:  # another held-out set, a damaged file: this seed only
                    log.warning("ablation_pair_skipped", pair=f"{roc} - {grpo}", seed=seed,
                                reason=str(e))
            if by_seed:
                out[f"{roc} - {grpo}"] = by_seed
    return out


def with_sampled_eval(figures: dict[str, Any], eval_dir: Path | None) -> dict[str, Any]:
    """A run's own evaluation figures (`eval_figures`) with the sampled ones of a separate
    evaluation of the same weights (`eval_dir/eval.json`, when written) in their place: greedy
    accuracy stays the run's; avg@k, maj@k, pass@k, the tool-error ratios and the response
    length become the separate evaluation's (a curriculum that evaluates greedily while it
    trains, as a long one on a CPU must, gets its avg@k this way). Before that evaluation has
    run, the run has no sampled figures (the report shows none), never its own greedy ones
    in their place."""
    if eval_dir is None:
        return figures
    path = eval_dir / "eval.json"
    extra = json.loads(path.read_text()) if path.exists() else {}
    sampled = tuple(k.removeprefix("eval/") for k in EVAL_KEYS if k != "eval/accuracy")
    return ({k: v for k, v in figures.items() if k.startswith("accuracy")}
            | {k: v for k, v in extra.items() if k.startswith(sampled)})


def read_sft(run_dir: Path, eval_k: int = 0) -> dict[str, Any]:
    """The after-SFT evaluation's figures of a cold-start run (`eval_figures`), with those of
    its separate sampled evaluation (`with_sampled_eval`) when `eval_k`."""
    evals = [r for r in _rows(run_dir) if r["kind"] == "eval"]
    own = eval_figures(next(r for r in evals if r.get("label") == "after_sft"))
    return with_sampled_eval(own, sampled_eval_dir(run_dir, eval_k) if eval_k else None)


def read_arm(run_dir: Path, tail: int, eval_k: int = 0) -> dict[str, Any]:
    """One finished arm run's figures: the final evaluation's (with those of its separate
    sampled evaluation when `eval_k`: `with_sampled_eval`), the tool-error ratios over the
    whole RL run and its last `tail` steps, the p_err of the trained positives, the mean
    response length and reward, the wall time, and the curves per step and per evaluation. A
    `DataError` for a run written before the tool-call counts were in `metrics.jsonl`."""
    rows = _rows(run_dir)
    steps = [r for r in rows if r["kind"] == "rl_step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = next((r for r in evals if r.get("label") == "final"), evals[-1])
    done = next((r for r in rows if r["kind"] == "done"), None)
    if steps and not any("rollout/tool_calls_pos" in r for r in steps):
        raise DataError(f"{run_dir} predates the tool-call counts in metrics.jsonl: "
                         "run it again (without --reuse)")
    kept_perr = [r["roc/p_err_kept_pos"] for r in steps if "roc/p_err_kept_pos" in r]
    return {
        "final": with_sampled_eval(eval_figures(final),
                                   sampled_eval_dir(run_dir, eval_k) if eval_k else None),
        "tool_error_pos_run": tool_error_ratio(steps, "pos"),
        "tool_error_all_run": tool_error_ratio(steps, "all"),
        "tool_error_pos_tail": tool_error_ratio(steps[-tail:], "pos"),
        "tool_error_all_tail": tool_error_ratio(steps[-tail:], "all"),
        "p_err_kept_pos_mean": fmean(kept_perr) if kept_perr else 0.0,
        "response_tokens_mean": fmean(r.get("rollout/response_tokens_mean", 0.0)
                                      for r in steps) if steps else 0.0,
        "reward_mean": fmean(r["reward/mean"] for r in steps) if steps else 0.0,
        # every attempt of a stopped and resumed run (`done` holds the last one's alone)
        "wall_s": max((t for t in run_clock(rows) if t is not None), default=None) if done
        else None,
        "curves": {
            "tool_error_pos": [r.get("rollout/tool_error_ratio_pos", 0.0) for r in steps],
            "tool_error_all": [r.get("rollout/tool_error_ratio", 0.0) for r in steps],
            "response_tokens": [r.get("rollout/response_tokens_mean", 0.0) for r in steps],
            "eval": [(r["step"], r["eval/accuracy"]) for r in evals],
            "eval_sampled": [(r["step"], avg) for r in evals
                             if (avg := sampled(eval_figures(r), "avg")) is not None],
            "eval_tool_error_correct": [(r["step"], r["eval/tool_error_ratio_correct"])
                                        for r in evals if "eval/tool_error_ratio_correct" in r],
        },
    }


def sampled(figures: dict, stat: str, level: int | None = None) -> float | None:
    """avg@k (or maj@k, pass@k) from an eval's figures, over all levels or one; None when the
    eval sampled nothing (a greedy-only run)."""
    key = sampled_key([{"kind": "eval", **figures}], f"{stat}@*")  # "avg@*" when none
    return figures.get(key if level is None else f"{key}_L{level}")
