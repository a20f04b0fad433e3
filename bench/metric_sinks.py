"""What a metric row costs the train loop with each sink, and what the trajectory viewer costs.

`MetricsWriter.write` runs on the event loop once per logged row (one per RL step, one per ten
SFT steps, one per eval), so a sink's time per row is time the rollouts of the next step do not
get. Rows are `rl_step`-shaped (`--keys` numeric metrics, like a real row's ~90) written
through:

- ``jsonl``: `metrics.jsonl` alone (always on),
- ``tensorboard``: plus TensorBoard event files,
- ``wandb``: plus an offline W&B run (`wandb-core` service; startup and finish timed apart).

With ``--run-dir RUN_DIR`` it also times `asyncrl.observe.viewer.write_viewer` on that run (reading
its eval/ and rollouts/ records, decoding turns, writing the page) and reports the page size.

    python bench/metric_sinks.py [--rows 500] [--keys 90] [--run-dir RUN_DIR]

Prints a table and writes ``bench/results/metric_sinks.json``. The load average before and
after is recorded: on a shared machine the figures are as good as the quiet it had.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import LoggingSection  # noqa: E402
from asyncrl.observe.metrics import MetricsWriter  # noqa: E402
from asyncrl.observe.sinks import open_sinks  # noqa: E402


def _row(step: int, keys: int) -> dict[str, object]:
    row: dict[str, object] = {"stage": "rl", "step": step, "policy_version": step,
                              "problem_ids": [f"p{i}" for i in range(16)]}
    for k in range(keys):
        row[f"ns{k % 6}/metric_{k}"] = (step * 0.37 + k) % 1.0
    return row


def _bench_sink(kind: str, rows: int, keys: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-sinks-") as d:
        run = Path(d)
        t0 = time.perf_counter()
        sinks = open_sinks(LoggingSection(sinks=[kind]) if kind != "jsonl" else LoggingSection(),
                           run, {"bench": True})
        open_s = time.perf_counter() - t0
        w = MetricsWriter(run, sinks=sinks)
        per_row = []
        for s in range(1, rows + 1):
            r = _row(s, keys)
            t = time.perf_counter()
            w.write("rl_step", **r)
            per_row.append(time.perf_counter() - t)
        t = time.perf_counter()
        w.close()
        close_s = time.perf_counter() - t
        per_row.sort()
        return {"sink": kind, "rows": rows, "keys": keys, "open_s": round(open_s, 3),
                "row_ms_mean": round(1e3 * statistics.fmean(per_row), 3),
                "row_ms_p50": round(1e3 * per_row[len(per_row) // 2], 3),
                "row_ms_p99": round(1e3 * per_row[int(len(per_row) * 0.99) - 1], 3),
                "close_s": round(close_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--keys", type=int, default=90)
    ap.add_argument("--sinks", default="jsonl,tensorboard,wandb")
    ap.add_argument("--run-dir", default=None, help="also time the viewer on this run")
    args = ap.parse_args()
    load_before = os.getloadavg()
    results = [_bench_sink(k, args.rows, args.keys) for k in args.sinks.split(",")]
    print(f"{'sink':<12} {'rows':>5} {'keys':>5} {'open s':>7} {'mean ms':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'close s':>8}")
    for r in results:
        print(f"{r['sink']:<12} {r['rows']:>5} {r['keys']:>5} {r['open_s']:>7} "
              f"{r['row_ms_mean']:>8} {r['row_ms_p50']:>7} {r['row_ms_p99']:>7} {r['close_s']:>8}")
    viewer = None
    if args.run_dir:
        from asyncrl.observe.viewer import load_sections, write_viewer

        run = Path(args.run_dir)
        plots = sorted((run / "report").glob("*.png"))
        t = time.perf_counter()
        path = write_viewer(run, plots)
        seconds = time.perf_counter() - t
        sections = load_sections(run)
        viewer = {"run_dir": str(run), "seconds": round(seconds, 2),
                  "bytes": path.stat().st_size, "sections": len(sections),
                  "rollouts": sum(len(s["rollouts"]) for s in sections)}
        print(f"\nviewer: {viewer['rollouts']} rollouts in {viewer['sections']} sections, "
              f"{viewer['bytes'] / 1e6:.2f} MB, written in {viewer['seconds']} s")
    out = ROOT / "bench" / "results" / "metric_sinks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "viewer": viewer, "argv": sys.argv[1:],
                               "machine": platform.platform(), "cpus": os.cpu_count(),
                               "load_before": load_before, "load_after": os.getloadavg()},
                              indent=2) + "\n")
    print(f"\nwrote {out} (load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
