"""Resample-on-Correct against plain GRPO over seeds: four arms from one cold start per seed.

For each seed, the curriculum's SFT stages run once (`runs/ablation/sft-seed{S}`); each arm then
runs the curriculum's RL stages from that SFT model (`model.path` and `tokenizer.path` set to
the SFT run's `final/` export, the stage list cut to the RL stages), so the arms of one seed
start from identical weights, tokenizer, data and seed and differ only in the selection rule:

- `roc-weighted`: RoC, positives drawn with weight 1 / (p_total + 0.1) (the paper);
- `roc-lowest`: RoC, the positives with the lowest p_total (the released code);
- `grpo-first`: plain GRPO on the first G of the 2G samples;
- `grpo-all`: plain GRPO on all 2G samples.

(Each RL run starts a fresh optimizer, where a one-file curriculum run carries the SFT stage's
AdamW state into RL; the arms are alike in this.)

Per arm, over seeds (mean, standard deviation, min, max and a 95% bootstrap interval of the
mean): final held-out greedy accuracy and sampled avg@k / maj@k (overall and per level), RL's
avg@k gain over the seed's cold start, the tool-error ratio (failed calls / calls) of correct
sampled eval answers (RoC's claim about the policy), of positive rollouts and of all rollouts
over the whole RL run and over its last `--tail` steps, the p_err of the positives the update
trained on, the mean response length, and the RL wall time. Each RoC arm minus each GRPO arm,
paired by seed, with its interval. Curves per RL step (tool-error ratios, response length) and
per evaluation (greedy, avg@k, tool errors of correct answers) go to a plot. Writes `bench/results/roc_ablation.{json,md,png}` and appends progress to
`runs/ablation/progress.log`.

    python bench/roc_ablation.py [--curriculum curricula/evidence.toml] [--seeds 0 1 2]
        [--arms roc-weighted grpo-first ...] [--set KEY=VALUE ...] [--reuse] [--report-only]

`--reuse` keeps every finished run (SFT or arm) and runs only the missing ones, so an
interrupted ablation continues where it stopped; `--report-only` runs nothing and summarises
the finished runs it finds. Each run takes minutes on 2 CPU cores; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from statistics import fmean, pstdev
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ARMS: dict[str, list[str]] = {
    "roc-weighted": ["roc.kind=roc", "roc.positive=weighted"],
    "roc-lowest": ["roc.kind=roc", "roc.positive=lowest"],
    "grpo-first": ["roc.kind=grpo_first"],
    "grpo-all": ["roc.kind=grpo_all"],
}


# ------------------------------------------------------------------------------- the runs
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
    """(SFT stages, RL stages) of the curriculum after `overrides`."""
    from asyncrl.config import apply_overrides

    data = apply_overrides(tomllib.loads(curriculum.read_text()), overrides)
    stages = data.get("stages", [])
    sft = [s for s in stages if s.get("kind") == "sft"]
    rl = [s for s in stages if s.get("kind", "rl") != "sft"]
    if not sft or not rl:
        raise SystemExit(f"{curriculum}: the ablation needs SFT and RL stages "
                         f"(found {len(sft)} and {len(rl)})")
    return sft, rl


def finished(run_dir: Path) -> bool:
    return (run_dir / "report" / "summary.md").exists() and (run_dir / "final").is_dir()


def log(out_dir: Path, msg: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}Z {msg}"
    print(line, flush=True)
    with (out_dir / "progress.log").open("a") as f:
        f.write(line + "\n")


def train(run_dir: Path, curriculum: Path, sets: list[str], out_dir: Path, what: str) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "asyncrl.cli.main", "train", str(curriculum), "--run-dir",
           str(run_dir), *(a for s in [*sets, "logging.console=none"] for a in ("--set", s))]
    log(out_dir, f"start {what}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        log(out_dir, f"FAILED {what} after {time.monotonic() - t0:.0f}s")
        raise SystemExit(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log(out_dir, f"done {what} in {time.monotonic() - t0:.0f}s")


def run_seed(seed: int, arms: list[str], args: argparse.Namespace, out_dir: Path
             ) -> None:
    sft_stages, rl_stages = split_stages(args.curriculum, args.set)
    common = [*args.set, f"run.seed={seed}"]
    sft_dir = out_dir / f"sft-seed{seed}"
    if not (args.reuse and finished(sft_dir)):
        train(sft_dir, args.curriculum, [*common, f"stages={toml_value(sft_stages)}"], out_dir,
              f"sft seed {seed}")
    final = (sft_dir / "final").resolve()
    for arm in arms:
        arm_dir = out_dir / f"{arm}-seed{seed}"
        if args.reuse and finished(arm_dir):
            continue
        train(arm_dir, args.curriculum,
              [*common, *ARMS[arm], f"model.path={json.dumps(str(final))}",
               f"tokenizer.path={json.dumps(str(final))}", f"stages={toml_value(rl_stages)}"],
              out_dir, f"{arm} seed {seed}")


# ---------------------------------------------------------------------------- the reading
def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def _ratio(steps: list[dict], prefix: str) -> float:
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


def _eval_figures(row: dict) -> dict[str, Any]:
    """An eval row's figures without the `eval/` prefix: greedy accuracy (`accuracy`), the
    sampled avg@k / maj@k / pass@k (per level too), and the tool-error ratios (of all calls and
    of the calls in correct sampled answers: `tool_error_ratio_correct`)."""
    return {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith(EVAL_KEYS)}


def read_sft(run_dir: Path) -> dict[str, Any]:
    evals = [r for r in _rows(run_dir) if r["kind"] == "eval"]
    return _eval_figures(next(r for r in evals if r.get("label") == "after_sft"))


def read_arm(run_dir: Path, tail: int) -> dict[str, Any]:
    rows = _rows(run_dir)
    steps = [r for r in rows if r["kind"] == "rl_step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = next((r for r in evals if r.get("label") == "final"), evals[-1])
    done = next((r for r in rows if r["kind"] == "done"), None)
    if steps and not any("rollout/tool_calls_pos" in r for r in steps):
        raise SystemExit(f"{run_dir} predates the tool-call counts in metrics.jsonl: "
                         "run it again (without --reuse)")
    kept_perr = [r["roc/p_err_kept_pos"] for r in steps if "roc/p_err_kept_pos" in r]
    return {
        "final": _eval_figures(final),
        "tool_error_pos_run": _ratio(steps, "pos"),
        "tool_error_all_run": _ratio(steps, "all"),
        "tool_error_pos_tail": _ratio(steps[-tail:], "pos"),
        "tool_error_all_tail": _ratio(steps[-tail:], "all"),
        "p_err_kept_pos_mean": fmean(kept_perr) if kept_perr else 0.0,
        "response_tokens_mean": fmean(r.get("rollout/response_tokens_mean", 0.0)
                                      for r in steps) if steps else 0.0,
        "reward_mean": fmean(r["reward/mean"] for r in steps) if steps else 0.0,
        "wall_s": done["wall_s"] if done else None,
        "curves": {
            "tool_error_pos": [r.get("rollout/tool_error_ratio_pos", 0.0) for r in steps],
            "tool_error_all": [r.get("rollout/tool_error_ratio", 0.0) for r in steps],
            "response_tokens": [r.get("rollout/response_tokens_mean", 0.0) for r in steps],
            "eval": [(r["step"], r["eval/accuracy"]) for r in evals],
            "eval_sampled": [(r["step"], avg) for r in evals
                             if (avg := sampled(_eval_figures(r), "avg")) is not None],
            "eval_tool_error_correct": [(r["step"], r["eval/tool_error_ratio_correct"])
                                        for r in evals if "eval/tool_error_ratio_correct" in r],
        },
    }


def sampled(figures: dict, stat: str, level: int | None = None) -> float | None:
    """avg@k (or maj@k, pass@k) from an eval's figures, over all levels or one; None when the
    eval sampled nothing (a greedy-only run)."""
    from asyncrl.observe.report import sampled_key

    key = sampled_key([{"kind": "eval", **figures}], f"{stat}@*")  # "avg@*" when none
    return figures.get(key if level is None else f"{key}_L{level}")


def _gain(r: dict) -> float | None:
    """Final avg@k minus the seed's after-SFT avg@k: what RL added to the sampled policy."""
    after = r.get("after_sft") or {}
    end, start = sampled(r["final"], "avg"), sampled(after, "avg")
    return None if end is None or start is None else end - start


def stats(xs: list[float], seed: int = 0) -> dict[str, Any]:
    """Mean, population sd, min, max and a 95% bootstrap interval of the mean over seeds."""
    rng = random.Random(seed)
    boots = sorted(fmean(rng.choices(xs, k=len(xs))) for _ in range(2000))
    return {"mean": fmean(xs), "sd": pstdev(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "ci95": (boots[50], boots[1949])}


def _level(lv: int) -> Any:
    return lambda r: r["final"].get(f"accuracy_L{lv}")


SCALARS = [
    ("greedy", lambda r: r["final"]["accuracy"]),
    *((f"greedy L{lv}", _level(lv)) for lv in (1, 2, 3, 4)),
    ("avg@k", lambda r: sampled(r["final"], "avg")),
    *((f"avg@k L{lv}", lambda r, lv=lv: sampled(r["final"], "avg", lv)) for lv in (1, 2, 3, 4)),
    ("maj@k", lambda r: sampled(r["final"], "maj")),
    ("avg@k gain over SFT", _gain),
    ("tool-err correct (eval)", lambda r: r["final"].get("tool_error_ratio_correct")),
    ("tool-err pos (run)", lambda r: r["tool_error_pos_run"]),
    ("tool-err pos (tail)", lambda r: r["tool_error_pos_tail"]),
    ("tool-err all (run)", lambda r: r["tool_error_all_run"]),
    ("tool-err all (tail)", lambda r: r["tool_error_all_tail"]),
    ("p_err trained pos", lambda r: r["p_err_kept_pos_mean"]),
    ("resp tokens", lambda r: r["response_tokens_mean"]),
    ("RL wall s", lambda r: r["wall_s"]),
]


def summarise(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, by_seed in results.items():
        out[arm] = {}
        for name, get in SCALARS:
            xs = [get(r) for r in by_seed.values()]
            xs = [float(x) for x in xs if x is not None]
            if xs:
                out[arm][name] = stats(xs)
    return out


HEADLINE = ["greedy", "avg@k", "avg@k gain over SFT", "maj@k", "tool-err correct (eval)",
            "tool-err pos (tail)", "p_err trained pos"]
# RoC's claim at the policy level: a RoC arm's correct answers make fewer tool errors than a
# GRPO arm's. Paired by seed (the arms of a seed share the cold start), RoC minus GRPO.
MIN_SEEDS_FOR_STAR = 3  # a one- or two-seed bootstrap interval is the seeds themselves
PAIRED = ["tool-err correct (eval)", "tool-err pos (tail)", "tool-err pos (run)", "avg@k",
          "greedy"]


def paired(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each RoC arm against each GRPO arm, the per-seed differences (RoC - GRPO) of the
    `PAIRED` figures over the seeds both finished: mean, sd and a 95% bootstrap interval."""
    getters = dict(SCALARS)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for roc in (a for a in results if a.startswith("roc")):
        for grpo in (a for a in results if a.startswith("grpo")):
            common = sorted(set(results[roc]) & set(results[grpo]))
            pair: dict[str, dict[str, Any]] = {}
            for name in PAIRED:
                diffs = []
                for seed in common:
                    x, y = getters[name](results[roc][seed]), getters[name](results[grpo][seed])
                    if x is not None and y is not None:
                        diffs.append(float(x) - float(y))
                if diffs:
                    pair[name] = {**stats(diffs), "seeds": common}
            if pair:
                out[f"{roc} - {grpo}"] = pair
    return out


def _cell(name: str, st: dict[str, Any], ci: bool = False) -> str:
    if name in ("resp tokens", "RL wall s"):
        return f"{st['mean']:.0f} ± {st['sd']:.0f}"
    text = f"{st['mean']:.3f} ± {st['sd']:.3f}"
    return text + (f" [{st['ci95'][0]:.3f}, {st['ci95'][1]:.3f}]" if ci else "")


def markdown(summary: dict, sft: dict[int, dict], seeds: dict[str, list[int]],
             pairs: dict | None = None, results: dict | None = None) -> str:
    lines = ["Headline figures per arm: mean ± sd over seeds [95% bootstrap interval of the "
             "mean].", "", "| arm | seeds | " + " | ".join(HEADLINE) + " |",
             "|---|---|" + "---|" * len(HEADLINE)]
    for arm, by_name in summary.items():
        cells = [_cell(n, by_name[n], ci=True) if n in by_name else "–" for n in HEADLINE]
        lines.append(f"| {arm} | {','.join(map(str, seeds[arm]))} | " + " | ".join(cells) + " |")
    if pairs:
        lines += ["", "RoC minus GRPO, paired by seed: mean ± sd [95% bootstrap interval]; "
                  f"`*` where the interval excludes zero over {MIN_SEEDS_FOR_STAR} or more seeds.", "",
                  "| pair | seeds | " + " | ".join(PAIRED) + " |", "|---|---|" + "---|" * len(PAIRED)]
        for pair, by_name in pairs.items():
            cells = []
            for n in PAIRED:
                st = by_name.get(n)
                if st is None:
                    cells.append("–")
                    continue
                lo, hi = st["ci95"]
                star = " *" if st["n"] >= MIN_SEEDS_FOR_STAR and (lo > 0 or hi < 0) else ""
                cells.append(f"{st['mean']:+.3f} ± {st['sd']:.3f} [{lo:+.3f}, {hi:+.3f}]{star}")
            some = next(iter(by_name.values()))
            lines.append(f"| {pair} | {','.join(map(str, some['seeds']))} | "
                         + " | ".join(cells) + " |")
    if results and sft:
        arms = list(results)
        lines += ["", "Per seed, avg@k after SFT (the arms' common start) and each arm's final "
                  "avg@k (greedy in brackets):", "",
                  "| seed | after SFT | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
        for seed, r in sorted(sft.items()):
            cells = []
            for arm in arms:
                run = results[arm].get(seed)
                avg = sampled(run["final"], "avg") if run else None
                cells.append("–" if run is None else
                             f"{avg:.3f} ({run['final']['accuracy']:.3f})" if avg is not None
                             else f"– ({run['final']['accuracy']:.3f})")
            start = sampled(r, "avg")
            lines.append(f"| {seed} | " + (f"{start:.3f}" if start is not None else "–")
                         + f" ({r['accuracy']:.3f}) | " + " | ".join(cells) + " |")
    names = [n for n, _ in SCALARS]
    lines += ["", "Every figure per arm: mean ± sd over seeds.", "",
              "| arm | seeds | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for arm, by_name in summary.items():
        cells = [_cell(n, by_name[n]) if n in by_name else "–" for n in names]
        lines.append(f"| {arm} | {','.join(map(str, seeds[arm]))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 3, figsize=(18, 8))
    axes = axes.ravel()
    colors = dict(zip(ARMS, ("C0", "C1", "C2", "C3"), strict=True))
    for arm, by_seed in results.items():
        for i, (_seed, r) in enumerate(sorted(by_seed.items())):
            label = arm if i == 0 else None
            c = r["curves"]
            for ax, key in zip(axes[:3], ("tool_error_pos", "tool_error_all", "response_tokens"),
                               strict=True):
                ax.plot(range(1, len(c[key]) + 1), c[key], color=colors[arm], alpha=0.7,
                        label=label)
            for ax, key in zip(axes[3:], ("eval", "eval_sampled", "eval_tool_error_correct"),
                               strict=True):
                if c.get(key):
                    ex, ey = zip(*c[key], strict=True)
                    ax.plot(ex, ey, marker="o", color=colors[arm], alpha=0.7, label=label)
    for ax, title in zip(axes, ("tool-error ratio, positive rollouts",
                                "tool-error ratio, all rollouts", "response tokens (mean)",
                                "held-out accuracy (greedy)", "held-out avg@k (sampled)",
                                "tool-error ratio, correct sampled eval answers"),
                           strict=True):
        ax.set(title=title, xlabel="RL step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curriculum", type=Path, default=ROOT / "curricula" / "evidence.toml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--set", action="append", default=[], help="config override, every run")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "ablation")
    ap.add_argument("--tail", type=int, default=5, help="last N RL steps for the tail ratios")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs, run the rest")
    ap.add_argument("--report-only", action="store_true", help="run nothing; summarise")
    args = ap.parse_args()
    args.curriculum = args.curriculum.resolve()
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        log(out_dir, f"ablation {args.curriculum.name} seeds={args.seeds} arms={args.arms} "
                     f"sets={args.set} reuse={args.reuse}")
        for seed in args.seeds:
            run_seed(seed, args.arms, args, out_dir)

    results: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    sft: dict[int, dict] = {}
    for seed in args.seeds:
        if finished(out_dir / f"sft-seed{seed}"):
            sft[seed] = read_sft(out_dir / f"sft-seed{seed}")
        for arm in args.arms:
            if finished(out_dir / f"{arm}-seed{seed}"):
                results[arm][seed] = read_arm(out_dir / f"{arm}-seed{seed}", args.tail)
                results[arm][seed]["after_sft"] = sft.get(seed)
    results = {a: r for a, r in results.items() if r}
    if not results:
        print("no finished arm runs under", out_dir)
        return 1
    summary = summarise(results)
    seeds = {arm: sorted(r) for arm, r in results.items()}
    pairs = paired(results)
    table = markdown(summary, sft, seeds, pairs, results)
    print("\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "roc_ablation.md").write_text(table)
    (RESULTS / "roc_ablation.json").write_text(json.dumps(
        {"curriculum": str(args.curriculum.relative_to(ROOT)) if args.curriculum.is_relative_to(
            ROOT) else str(args.curriculum), "overrides": args.set, "seeds": seeds,
         "after_sft": sft, "summary": summary, "paired": pairs, "runs": results}, indent=1))
    plot(results, RESULTS / "roc_ablation.png")
    print(f"wrote {RESULTS / 'roc_ablation.json'}, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
