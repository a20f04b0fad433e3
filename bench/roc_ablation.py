"""GRPO-RoC vs plain GRPO on the tiny curriculum, same seeds.

Runs `asyncrl train curricula/tiny.toml` once per arm (`roc.kind = "roc"` and `"grpo_first"`,
i.e. the first G of the 2G samples with no resampling), for each seed, and reports per arm:
held-out accuracy (after SFT, and final), and the tool-error ratio of positive rollouts
(failed calls / calls, over rollouts with reward 1) per RL step and over the whole run (all
its positive rollouts' calls together: a step without such calls adds nothing, rather than a 0).
Prints a table, writes `bench/results/roc_ablation.json` and a plot `roc_ablation.png`.

    python bench/roc_ablation.py [--seeds 0 1] [--set KEY=VALUE ...] [--reuse]

Each run takes the tiny curriculum's time (minutes on 2 CPU cores); not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ARMS = {"roc": "roc", "grpo": "grpo_first"}


def run_arm(arm: str, seed: int, extra: list[str], reuse: bool) -> Path:
    run_dir = ROOT / "runs" / "ablation" / f"{arm}-seed{seed}"
    if reuse and (run_dir / "report" / "summary.md").exists():
        return run_dir
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "curricula/tiny.toml",
           "--run-dir", str(run_dir), "--set", f"roc.kind={ARMS[arm]}",
           "--set", f"run.seed={seed}", "--set", "logging.console=none",
           *(arg for s in extra for arg in ("--set", s))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {arm} seed {seed}: {time.monotonic() - t0:.0f}s", flush=True)
    return run_dir


def read(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r["kind"] == "rl_step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    before = next((r for r in evals if r.get("label") == "after_sft"), evals[0])
    final = next((r for r in evals if r.get("label") == "final"), evals[-1])
    if steps and not any("rollout/tool_calls_pos" in r for r in steps):
        raise SystemExit(f"{run_dir} predates the tool-call counts in metrics.jsonl: "
                         "run it again (without --reuse)")
    pos_calls = sum(r.get("rollout/tool_calls_pos", 0.0) for r in steps)
    pos_errors = sum(r.get("rollout/tool_errors_pos", 0.0) for r in steps)
    return {
        "eval_after_sft": before["eval/accuracy"],
        "eval_final": final["eval/accuracy"],
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
        "tool_error_ratio_pos_curve": [(r["step"], r.get("rollout/tool_error_ratio_pos", 0.0))
                                       for r in steps],
        "tool_error_ratio_pos_run": pos_errors / pos_calls if pos_calls else 0.0,
        "tool_calls_pos": pos_calls,
        "reward_mean": fmean(r["reward/mean"] for r in steps) if steps else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", action="append", default=[], help="extra config override")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs")
    args = ap.parse_args()
    results: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            results[arm][seed] = read(run_arm(arm, seed, args.set, args.reuse))

    print(f"\n{'arm':6} {'seed':>4} {'acc after SFT':>14} {'acc final':>10} "
          f"{'tool-err(pos) run':>19} {'reward mean':>12}")
    for arm, by_seed in results.items():
        for seed, r in by_seed.items():
            print(f"{arm:6} {seed:>4} {r['eval_after_sft']:>14.3f} {r['eval_final']:>10.3f} "
                  f"{r['tool_error_ratio_pos_run']:>19.4f} {r['reward_mean']:>12.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "roc_ablation.json"
    out.write_text(json.dumps({"seeds": args.seeds, "overrides": args.set,
                               "results": results}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for arm, by_seed in results.items():
            for seed, r in by_seed.items():
                xs, ys = zip(*r["tool_error_ratio_pos_curve"], strict=True) if r[
                    "tool_error_ratio_pos_curve"] else ((), ())
                axes[0].plot(xs, ys, label=f"{arm} s{seed}")
                ex, ey = zip(*r["eval_curve"], strict=True)
                axes[1].plot(ex, ey, marker="o", label=f"{arm} s{seed}")
        axes[0].set(title="tool-error ratio of positive rollouts", xlabel="RL step")
        axes[1].set(title="held-out accuracy (greedy)", xlabel="RL step")
        for ax in axes:
            ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "roc_ablation.png", dpi=110)
    except ImportError:
        pass
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
