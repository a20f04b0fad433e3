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
paired by seed, with its interval; with `--eval-k`, per seed also paired by held-out problem
(`ablation_runs.paired_by_problem`). Curves per RL step (tool-error ratios, response length)
and per evaluation (greedy, avg@k, tool errors of correct answers) go to a plot. Writes
`bench/results/<--name>.{json,md,png}` (`roc_ablation` by default) and appends progress to
`runs/ablation/progress.log`. The arms and what is read from a run are
`asyncrl/analysis/ablation_runs.py`, the statistics and the tables
`asyncrl/analysis/ablation_report.py`; this script runs the trainings and writes.

    python bench/roc_ablation.py [--curriculum curricula/evidence.toml] [--seeds 0 1 2]
        [--arms roc-weighted grpo-first ...] [--set KEY=VALUE ...] [--reuse] [--report-only]
        [--eval-k 8 [--eval-temperature 1]] [--name roc_ablation]

`--eval-k K` also evaluates each finished run's `final/` (the cold start's and each arm's) with
K samples per problem at `--eval-temperature` (default 1), apart from its training: `asyncrl
eval --k K --no-greedy` into `<run>/eval-k{K}/`, with the same `--set` overrides; a seed's cold
start's after its arms', which compare without it. Its avg@K and tool-error ratios then stand
in the report for those of the run's own final evaluation (whose greedy accuracy stays): a
curriculum that evaluates only greedily while it trains, as a long one on a CPU must, gets its
avg@K and the tool errors of correct sampled answers this way. Such an evaluation journals each
finished problem, so an interrupted one goes on where it stopped.

`--reuse` keeps every finished run (SFT or arm), resumes an unfinished one from its last
checkpoint (`asyncrl train --resume`, the same overrides) and runs the missing ones, so an
interrupted ablation continues where it stopped (stop a run with SIGINT: it checkpoints);
`--report-only` runs nothing and summarises the finished runs it finds. Each run takes minutes
on 2 CPU cores; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.analysis.ablation_report import markdown, paired, summarise
from asyncrl.analysis.ablation_runs import (
    ARMS,
    paired_by_problem,
    read_arm,
    read_sft,
    sampled_eval_dir,
    split_stages,
    toml_value,
)
from asyncrl.checkpoint import latest_checkpoint
from asyncrl.config import load as load_config
from asyncrl.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# ------------------------------------------------------------------------------- the runs
def finished(run_dir: Path) -> bool:
    return (run_dir / "report" / "summary.md").exists() and (run_dir / "final").is_dir()


def log(out_dir: Path, msg: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())}Z {msg}"
    print(line, flush=True)
    with (out_dir / "progress.log").open("a") as f:
        f.write(line + "\n")


def resumable(run_dir: Path) -> bool:
    """An unfinished run that left a checkpoint (stopped with SIGINT/SIGTERM, or killed after
    one was written): `asyncrl train --resume` continues it."""
    return latest_checkpoint(run_dir) is not None


def train(run_dir: Path, curriculum: Path, sets: list[str], out_dir: Path, what: str,
          reuse: bool = False) -> None:
    resume = reuse and resumable(run_dir)
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "asyncrl.cli.main", "train", str(curriculum), "--run-dir",
           str(run_dir), *(["--resume"] if resume else []),
           *(a for s in [*sets, "logging.console=none"] for a in ("--set", s))]
    run_logged(cmd, out_dir, what + (" (resumed)" if resume else ""))


def run_logged(cmd: list[str], out_dir: Path, what: str) -> None:
    """Run `cmd` in the repo, its start, end and seconds in the progress log; exit on failure."""
    log(out_dir, f"start {what}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        log(out_dir, f"FAILED {what} after {time.monotonic() - t0:.0f}s")
        raise SystemExit(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log(out_dir, f"done {what} in {time.monotonic() - t0:.0f}s")


def eval_command(run_dir: Path, curriculum: Path, sets: list[str], k: int,
                 temperature: float, max_problems: int) -> list[str]:
    """`asyncrl eval` of a finished run's `final/`: k samples a problem, no greedy pass, on the
    problems its own evaluations scored (`sets` hold its `run.seed`: a generator's held-out
    set follows it; `max_problems` is its `eval.max_problems`)."""
    return [sys.executable, "-m", "asyncrl.cli.main", "eval", str(curriculum), "--checkpoint",
            str(run_dir / "final"), "--k", str(k), "--temperature", str(temperature),
            "--no-greedy", "--max-problems", str(max_problems),
            "--out", str(sampled_eval_dir(run_dir, k)),
            *(a for s in [*sets, "logging.console=none"] for a in ("--set", s))]


def sampled_eval(run_dir: Path, args: argparse.Namespace, seed: int, out_dir: Path,
                 what: str) -> None:
    """`--eval-k`: evaluate the run's `final/` unless done (an interrupted one resumes)."""
    if not args.eval_k:
        return
    done = sampled_eval_dir(run_dir, args.eval_k) / "eval.json"
    if done.exists():
        temp = json.loads(done.read_text()).get("temperature")
        if temp != args.eval_temperature:
            raise SystemExit(f"{done} was sampled at temperature {temp}, not "
                             f"{args.eval_temperature}: remove it or pass that temperature")
        return
    sets = [*args.set, f"run.seed={seed}"]
    max_problems = load_config(args.curriculum, sets).eval.max_problems
    run_logged(eval_command(run_dir, args.curriculum, sets, args.eval_k, args.eval_temperature,
                            max_problems), out_dir, f"avg@{args.eval_k} of {what}")


def run_seed(seed: int, arms: list[str], args: argparse.Namespace, out_dir: Path
             ) -> None:
    sft_stages, rl_stages = split_stages(args.curriculum, args.set)
    common = [*args.set, f"run.seed={seed}"]
    sft_dir = out_dir / f"sft-seed{seed}"
    if not (args.reuse and finished(sft_dir)):
        train(sft_dir, args.curriculum, [*common, f"stages={toml_value(sft_stages)}"], out_dir,
              f"sft seed {seed}", args.reuse)
    final = (sft_dir / "final").resolve()
    for arm in arms:
        arm_dir = out_dir / f"{arm}-seed{seed}"
        if not (args.reuse and finished(arm_dir)):
            train(arm_dir, args.curriculum,
                  [*common, *ARMS[arm], f"model.path={json.dumps(str(final))}",
                   f"tokenizer.path={json.dumps(str(final))}", f"stages={toml_value(rl_stages)}"],
                  out_dir, f"{arm} seed {seed}", args.reuse)
        sampled_eval(arm_dir, args, seed, out_dir, f"{arm} seed {seed}")
    # the cold start's last: the arms compare without it; only their gain over it needs it
    sampled_eval(sft_dir, args, seed, out_dir, f"sft seed {seed}")


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
    ap.add_argument("--eval-k", type=int, default=0,
                    help="also evaluate each run's final/ with K samples a problem (avg@K)")
    ap.add_argument("--eval-temperature", type=float, default=1.0)
    ap.add_argument("--name", default="roc_ablation",
                    help="results file stem under bench/results (one per curriculum studied)")
    args = ap.parse_args()
    try:
        return ablation(args)
    except (ConfigError, DataError) as e:  # a curriculum without both stages; an old run
        raise SystemExit(str(e)) from None


def ablation(args: argparse.Namespace) -> int:
    args.curriculum = args.curriculum.resolve()
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        log(out_dir, f"ablation {args.curriculum.name} seeds={args.seeds} arms={args.arms} "
                     f"sets={args.set} reuse={args.reuse} eval_k={args.eval_k}")
        for seed in args.seeds:
            run_seed(seed, args.arms, args, out_dir)

    results: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    sft: dict[int, dict] = {}
    for seed in args.seeds:
        if finished(out_dir / f"sft-seed{seed}"):
            sft[seed] = read_sft(out_dir / f"sft-seed{seed}", args.eval_k)
        for arm in args.arms:
            if finished(out_dir / f"{arm}-seed{seed}"):
                results[arm][seed] = read_arm(out_dir / f"{arm}-seed{seed}", args.tail,
                                              args.eval_k)
                results[arm][seed]["after_sft"] = sft.get(seed)
    results = {a: r for a, r in results.items() if r}
    if not results:
        print("no finished arm runs under", out_dir)
        return 1
    summary = summarise(results)
    seeds = {arm: sorted(r) for arm, r in results.items()}
    pairs = paired(results)
    by_problem = paired_by_problem(
        {arm: {seed: out_dir / f"{arm}-seed{seed}" for seed in r} for arm, r in results.items()},
        args.eval_k) if args.eval_k else {}
    table = markdown(summary, sft, seeds, pairs, results, by_problem)
    print("\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(table)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"curriculum": str(args.curriculum.relative_to(ROOT)) if args.curriculum.is_relative_to(
            ROOT) else str(args.curriculum), "overrides": args.set, "seeds": seeds,
         "after_sft": sft, "summary": summary, "paired": pairs, "paired_by_problem": by_problem,
         "runs": results}, indent=1))
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
