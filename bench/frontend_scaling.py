"""HTTP front ends vs. the in-process pool, interleaved so a shared machine's load hits all alike.

Starts, once, the in-process ``SandboxPool`` and one ``sandbox serve`` node per front-end
count (``--front-ends 1,2``: ``--front-ends N`` each, all with ``--workers`` zygotes), then for
``--rounds`` rounds runs the same closed loop (``--concurrency`` callers, ``--calls`` calls of
each ``--workloads`` program from ``bench/tool-workloads.json``) against each of
them in turn. Idle systems cost no CPU (their zygotes sleep), so each round compares the
modes under the same background load; the figure is the median over rounds of each mode's
calls/s divided by the pool's in the same round. The issue's bar: HTTP >= 90% of the pool.

    python bench/frontend_scaling.py [--workers 2] [--front-ends 1,2] [--rounds 7] [--quick]

Prints a table and writes ``bench/results/frontend_scaling.json`` (with every round's
figures and the load average around each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tool_latency import DEFAULT_WORKLOADS, closed_loop, start_server  # noqa: E402

from sandbox import ExecRequest, HttpSandboxClient, LocalSandboxClient, PoolConfig  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "frontend_scaling.json"


async def main_async(args, spec: dict) -> dict:
    workloads = {w["id"]: w for w in spec["workloads"]}
    limit = float(spec["time_limit_s"])
    clients: dict[str, LocalSandboxClient | HttpSandboxClient] = {}
    servers = []
    out: dict = {"cpus": os.cpu_count(), "workers": args.workers, "argv": sys.argv[1:],
                 "concurrency": args.concurrency, "calls": args.calls, "rounds": []}
    try:
        clients["pool"] = await LocalSandboxClient(PoolConfig(workers=args.workers)).__aenter__()
        for n in args.front_ends:
            proc, url = await start_server(args.workers, n)
            servers.append(proc)
            clients[f"http:{n}"] = await HttpSandboxClient(
                [url], batch_size=64, batch_window_ms=2.0).__aenter__()
        out["isolation"] = {m: c.isolation for m, c in clients.items()}
        for c in clients.values():  # warm: first forks, connections
            await closed_loop(c, ExecRequest("print(1)", "", limit), 200, args.concurrency)
        print(f"cpus {os.cpu_count()}  workers {args.workers}  concurrency {args.concurrency}  "
              f"calls {args.calls}  isolation {out['isolation']['pool']}")
        print(f"{'round':>5} {'workload':11} " + " ".join(f"{m:>9}" for m in clients)
              + "  load1 (calls/s)")
        for rnd in range(args.rounds):
            for wid in args.workloads_ids:
                w = workloads[wid]
                req = ExecRequest(w["code"], w["input"], limit)
                load = os.getloadavg()[0]
                rates = {}
                order = list(clients) if rnd % 2 == 0 else list(reversed(clients))
                for mode in order:
                    _, res, wall = await closed_loop(clients[mode], req, args.calls,
                                                     args.concurrency)
                    rates[mode] = len(res) / wall
                    bad = sum(1 for r in res if r.status != w["expect"])
                    if bad:
                        raise RuntimeError(f"{mode} {wid}: {bad} calls not {w['expect']}")
                out["rounds"].append({"round": rnd, "workload": wid, "calls_per_s": rates,
                                      "load1_before": load, "load1_after": os.getloadavg()[0]})
                print(f"{rnd:>5} {wid:11} " + " ".join(f"{rates[m]:>9.1f}" for m in clients)
                      + f"  {load:.1f}", flush=True)
    finally:
        for c in clients.values():
            await c.aclose()
        for proc in servers:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
    summary = {}
    print(f"\nmedian over {args.rounds} rounds of calls/s relative to the pool in the same round")
    for wid in args.workloads_ids:
        rows = [r for r in out["rounds"] if r["workload"] == wid]
        summary[wid] = {m: {"median_calls_per_s": statistics.median(r["calls_per_s"][m]
                                                                  for r in rows),
                            "median_ratio_to_pool": statistics.median(
                                r["calls_per_s"][m] / r["calls_per_s"]["pool"] for r in rows)}
                        for m in clients}
        print(f"  {wid:11} " + "  ".join(
            f"{m} {s['median_calls_per_s']:.0f}/s ({s['median_ratio_to_pool']:.0%})"
            for m, s in summary[wid].items()))
    out["summary"] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=str(DEFAULT_WORKLOADS))
    p.add_argument("--workload-ids", dest="workloads_ids", default="W1-trivial,W3-sympy")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--front-ends", default="1,2", help="comma-separated front-end counts")
    p.add_argument("--rounds", type=int, default=None, help="default 7 (--quick: 3)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--calls", type=int, default=None, help="default 1000 (--quick: 300)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 300 calls: about a minute")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.calls = args.calls or (300 if args.quick else 1000)
    args.front_ends = [int(n) for n in args.front_ends.split(",") if n]
    args.workloads_ids = [w for w in args.workloads_ids.split(",") if w]
    out = asyncio.run(main_async(args, json.loads(Path(args.workloads).read_text())))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
