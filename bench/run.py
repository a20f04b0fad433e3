"""The CPU benchmark set, full or quick: what `just bench` and `just bench quick` run.

Owns the list of CPU benches and each one's quick setting; not any bench's measurement (each
script owns its own, prints its own table and writes its own JSON). Every script runs as its
own process with its output passed through as it comes. The runner then checks, per bench,
that it exited 0, printed its table (a header line that bench always prints) and wrote its JSON
under ``bench/results/`` during this run, and ends with one summary line per bench and
``bench: N of N ok (...)``; any miss makes the exit status 1. Timings are reported, never
judged: a bench whose own bar says FAIL on a loaded machine still counts as ok.

    python bench/run.py [full|quick] [--only tool_latency,tool_fire]

Quick is a few minutes on 2 cores (fewer calls, rounds, rollouts and streams).
Writes ``bench/results/run.json`` (mode, and each bench's wall time and checks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Bench:
    name: str  # bench/<name>.py
    full: tuple[str, ...]
    quick: tuple[str, ...]
    table: str  # a regex matching a header line of the table the bench prints
    json: str  # the file it writes under bench/results/


BENCHES = (
    Bench("tool_latency", (), ("--quick",), r"^mode\s+workload\s+conc\s+calls", "tool_latency.json"),
    Bench("frontend_scaling", (), ("--quick",), r"^median over \d+ rounds of calls/s",
          "frontend_scaling.json"),
    Bench("tool_fire", (), ("--quick",), r"^clock\s+p50 ms\s+p90 ms\s+p99 ms", "tool_fire.json"),
    Bench("loop_capacity", (), ("--quick",), r"^\s*loop lag\s+p50 ms", "loop_capacity.json"),
    Bench("scheduler_sim", (), ("--quick",), r"^policy\s+tok/s\s+vs static", "scheduler_sim.json"),
    # full keeps what `just bench` always ran here (its own --quick sizes: the whole sweep, to
    # 256 streams of 256 tokens, is a long CPU run); quick drops the 64-stream rows
    Bench("local_engine", ("--quick", "--churn"), ("--quick", "--churn", "--streams", "16"),
          r"^model\s+streams\s+(\S+ tok/s\s+)+generate tok/s", "local_engine.json"),
    Bench("metric_sinks", (), (), r"^sink\s+rows\s+keys", "metric_sinks.json"),  # seconds
    Bench("sft_step", (), ("--steps", "5", "--rounds", "1", "--budgets", "8192", "1024"),
          r"^\s*micro_batch_tokens\s+ms/step", "sft_step.json"),
)
# Not here: gpu_sweep.py --dry-run. Its figures check the GPU sweep, not CPU speed, and CI's
# smoke runs it on its own (.ci/smoke.py), so `just bench quick` stays a few minutes.


def run_one(b: Bench, mode: str, timeout_s: float) -> dict:
    """Run one bench, streaming its output; returns its row of the summary."""
    argv = [sys.executable, str(ROOT / "bench" / f"{b.name}.py"),
            *(b.quick if mode == "quick" else b.full)]
    print(f"\n=== bench/{b.name}.py {' '.join(argv[2:])}".rstrip(), flush=True)
    out_json = RESULTS / b.json
    start = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    table = re.compile(b.table)
    printed_table = False
    assert proc.stdout is not None
    for line in proc.stdout:  # the bench's own deadline is `timeout_s`, checked per line
        sys.stdout.write(line)
        sys.stdout.flush()
        printed_table = printed_table or bool(table.search(line))
        if time.time() - start > timeout_s:
            proc.kill()
            break
    rc = proc.wait()
    wall = time.time() - start
    wrote = out_json.exists() and out_json.stat().st_mtime >= start
    if wrote:
        try:
            json.loads(out_json.read_text())
        except ValueError:
            wrote = False
    problems = [p for p, bad in ((f"exit {rc}", rc != 0),
                                 (f"past {timeout_s:.0f}s", wall > timeout_s),
                                 ("no table", not printed_table),
                                 (f"no {b.json}", not wrote)) if bad]
    return {"bench": b.name, "argv": argv[2:], "wall_s": round(wall, 1), "rc": rc,
            "table": printed_table, "json": wrote, "ok": not problems, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="full", choices=("full", "quick"))
    ap.add_argument("--only", default="", help="comma-separated bench names (default: all)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per bench (default 600 quick, 3600 full)")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown bench(es): {', '.join(sorted(unknown))}")
    chosen = [b for b in BENCHES if not names or b.name in names]
    timeout_s = args.timeout or (600.0 if args.mode == "quick" else 3600.0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = [run_one(b, args.mode, timeout_s) for b in chosen]
    total = time.time() - start
    print(f"\n{'bench':<18} {'wall s':>7}  result")
    for r in rows:
        print(f"{r['bench']:<18} {r['wall_s']:>7}  {'ok' if r['ok'] else ', '.join(r['problems'])}")
    ok = sum(r["ok"] for r in rows)
    (RESULTS / "run.json").write_text(json.dumps(
        {"mode": args.mode, "wall_s": round(total, 1), "cpus": os.cpu_count(),
         "load_after": os.getloadavg(), "benches": rows}, indent=1) + "\n")
    print(f"bench: {ok} of {len(rows)} ok ({args.mode}, {total:.0f} s); "
          f"wrote {RESULTS / 'run.json'}")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
