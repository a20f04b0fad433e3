"""Bounded staleness on the tiny curriculum: N = 0 vs N = 2, with and without correction.

One shared SFT cold start (the tiny curriculum's SFT stage alone, seed 0, exported as an HF
directory), then, per seed and arm, the tiny curriculum's RL stages started from it
(`model.path` = that directory, `stages` = the RL stages only), so the SFT minutes are paid
once. Arms (`--arms`, default all):

- `n0`: `rollout.max_staleness = 0`, `algorithm.correction = "decoupled"` (on-policy; the
  correction only sees the sampler/trainer kernel mismatch);
- `n2`: `max_staleness = 2`, `correction = "decoupled"`;
- `n2-none`: `max_staleness = 2`, `correction = "none"` (stale tokens trained as on-policy).

Per run it reports: wall time per RL step (the RL run's wall time, evaluations included, over
its steps; and the mean of `timing/step_s`, the loop's own step time, which excludes the
evaluations and checkpoints between steps), the mean stale-token fraction and the largest
version lag over steps, the mean mismatch KL (k3) and the final held-out accuracy (greedy).
Seeds run one after another with the arms interleaved (seed-major), so that load on a shared
machine hits every arm alike. Prints a table, writes `bench/results/async_staleness.json`
(`--out` elsewhere); the runs go under `runs/async` (`--runs-dir` elsewhere).

    python bench/async_staleness.py [--seeds 0 1 2] [--arms n0 n2 n2-none] [--rl-stages 2]
                                    [--sft-dir DIR] [--set KEY=VALUE ...] [--reuse]
                                    [--runs-dir DIR] [--out PATH]

Minutes per run on 2 CPU cores; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from statistics import fmean, pstdev

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs" / "async"
CURRICULUM = ROOT / "curricula" / "tiny.toml"
ARMS = {
    "n0": ["rollout.max_staleness=0", 'algorithm.correction="decoupled"'],
    "n2": ["rollout.max_staleness=2", 'algorithm.correction="decoupled"'],
    "n2-none": ["rollout.max_staleness=2", 'algorithm.correction="none"'],
}


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _stages(kind: str, n_rl: int) -> str:
    """The tiny curriculum's SFT stage, or its first `n_rl` RL stages, as a TOML array."""
    stages = tomllib.loads(CURRICULUM.read_text())["stages"]
    if kind == "sft":
        picked = [s for s in stages if s.get("kind") == "sft"]
    else:
        picked = [s for s in stages if s.get("kind", "rl") != "sft"][:n_rl]
    return _toml_value(picked)


def _train(run_dir: Path, sets: list[str]) -> float:
    cmd = [sys.executable, "-m", "asyncrl.cli.main", "train", str(CURRICULUM), "--run-dir",
           str(run_dir), "--set", "logging.console=none",
           *(arg for s in sets for arg in ("--set", s))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.monotonic() - t0


def sft(runs: Path, reuse: bool) -> Path:
    run_dir = runs / "sft-seed0"
    final = run_dir / "final"
    if reuse and (final / "config.json").exists():
        return final
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    s = _train(run_dir, [f"stages={_stages('sft', 0)}", "run.seed=0"])
    print(f"  sft: {s:.0f}s", flush=True)
    return final


def run_arm(runs: Path, arm: str, seed: int, sft_dir: Path, n_rl: int, extra: list[str],
            reuse: bool) -> Path:
    run_dir = runs / f"{arm}-seed{seed}"
    if reuse and (run_dir / "report" / "summary.md").exists():
        return run_dir
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    s = _train(run_dir, [f'model.path="{sft_dir}"', f"stages={_stages('rl', n_rl)}",
                         f"run.seed={seed}", *ARMS[arm], *extra])
    print(f"  {arm} seed {seed}: {s:.0f}s", flush=True)
    return run_dir


def read(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r["kind"] == "rl_step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    done = next(r for r in rows if r["kind"] == "done")
    final = next((r for r in evals if r.get("label") == "final"), evals[-1])
    first = next((r for r in evals if r.get("label") == "step"), None)
    return {
        "steps": len(steps),
        "wall_s": done["wall_s"],
        "wall_per_step_s": done["wall_s"] / max(1, len(steps)),
        "step_s_mean": fmean(r["timing/step_s"] for r in steps),
        "wait_rollouts_s_mean": fmean(r.get("timing/wait_rollouts_s", 0.0) for r in steps),
        "update_s_mean": fmean(r["timing/update_s"] for r in steps),
        "stale_token_frac_mean": fmean(r.get("async/stale_token_frac", 0.0) for r in steps),
        "version_lag_max": max(r.get("async/version_lag_max", 0.0) for r in steps),
        "mixed_version_rollouts": sum(r.get("async/mixed_version_rollouts", 0.0)
                                      for r in steps),
        "groups_dropped_stale": sum(r.get("async/groups_dropped_stale", 0.0) for r in steps),
        "mismatch_kl_mean": fmean(r.get("train/mismatch_kl", 0.0) for r in steps),
        "corr_masked_frac_mean": fmean(r.get("train/corr_masked_frac", 0.0) for r in steps),
        "reward_mean": fmean(r["reward/mean"] for r in steps),
        "eval_first": first["eval/accuracy"] if first else None,
        "eval_final": final["eval/accuracy"],
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--rl-stages", type=int, default=3,
                    help="how many of the tiny curriculum's RL stages to run (default all 3)")
    ap.add_argument("--sft-dir", default=None, help="an HF directory to start RL from")
    ap.add_argument("--set", action="append", default=[], help="extra config override")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs")
    ap.add_argument("--runs-dir", type=Path, default=RUNS,
                    help=f"where the runs go (default {RUNS.relative_to(ROOT)})")
    ap.add_argument("--out", type=Path, default=RESULTS / "async_staleness.json")
    args = ap.parse_args()
    sft_dir = Path(args.sft_dir) if args.sft_dir else sft(args.runs_dir, args.reuse)
    results: dict[str, dict[int, dict]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            results[arm][seed] = read(run_arm(args.runs_dir, arm, seed, sft_dir, args.rl_stages,
                                              args.set, args.reuse))

    cols = ("wall/step s", "step_s", "stale tok", "lag max", "mismatch KL", "acc final")
    print(f"\n{'arm':8} {'seed':>4} " + " ".join(f"{c:>11}" for c in cols))
    summary: dict[str, dict[str, float]] = {}
    for arm, by_seed in results.items():
        for seed, r in by_seed.items():
            vals = (r["wall_per_step_s"], r["step_s_mean"], r["stale_token_frac_mean"],
                    r["version_lag_max"], r["mismatch_kl_mean"], r["eval_final"])
            print(f"{arm:8} {seed:>4} " + " ".join(f"{v:>11.4g}" for v in vals))
        rs = list(by_seed.values())
        summary[arm] = {k: fmean(r[k] for r in rs) for k in
                        ("wall_per_step_s", "step_s_mean", "stale_token_frac_mean",
                         "version_lag_max", "mismatch_kl_mean", "eval_final")}
        summary[arm]["eval_final_std"] = pstdev([r["eval_final"] for r in rs])
        summary[arm]["seeds"] = len(rs)
    print("\nmean over seeds:")
    for arm, m in summary.items():
        print(f"{arm:8} n={m['seeds']:.0f} wall/step {m['wall_per_step_s']:.2f}s  "
              f"step_s {m['step_s_mean']:.2f}s  stale {m['stale_token_frac_mean']:.3f}  "
              f"lag max {m['version_lag_max']:.0f}  acc {m['eval_final']:.3f} "
              f"(sd {m['eval_final_std']:.3f})")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "arms": {a: ARMS[a] for a in args.arms},
                               "rl_stages": args.rl_stages, "sft_dir": str(sft_dir),
                               "overrides": args.set, "results": results,
                               "summary": summary}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
