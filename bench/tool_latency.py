"""Tool-call latency and throughput of the sandbox, against a naive baseline.

The standard workloads of ``bench/tool-workloads.json`` (W1..W7), exactly as given,
at its concurrency points (closed loop: ``concurrency`` callers, each sending its next call
when the previous one is answered), against

- ``pool``:  ``SandboxPool`` in this process (through ``LocalSandboxClient``),
- ``http``:  ``python -m sandbox serve`` on loopback, through ``HttpSandboxClient`` (batching),
- ``naive``: one fresh ``sys.executable -c CODE`` subprocess per call (the real interpreter,
  not a shim), killed at the time limit.

Plus the W7 measurement: how long until W7's (timeout) result arrives, and the latency of W1
calls sent while it runs, next to W1 alone at the same concurrency.

``http:N`` (e.g. ``--modes pool,http,http:2``) is the server with N front-end processes on one
port (``sandbox serve --front-ends N``), the node's workers split between them.

Open loop (``--open-loop 0.25,0.5,0.75,0.9``): a closed loop cannot show latency under a given
load (by Little's law its latency is concurrency / rate). Here each mode's capacity for a
workload is first measured closed-loop (``--capacity-concurrency`` callers), then calls
arrive as a Poisson process at each given fraction of it for ``--open-seconds``, each sent
when it arrives, whatever is still outstanding. Latency is counted from the scheduled arrival
(so a late sender is no excuse: no coordinated omission); ``served/s`` is calls answered per
second from the first arrival to the last answer, ``offered/s`` the arrivals per second.

    python bench/tool_latency.py [--quick] [--modes pool,http,naive] [--workloads PATH]
    python bench/tool_latency.py --open-loop 0.25,0.5,0.75,0.9 --modes pool,http,http:2

Prints a table and writes ``bench/results/tool_latency.json`` (open loop only:
``tool_latency_open.json``). Latency is per call as the
caller sees it (queueing included); ``sbx_p99`` is the p99 of the sandbox's own fork-to-exit
``duration_s``. A closed loop obeys Little's law: at concurrency C, mean latency = C / rate,
so at C = 64 no system under ~3,200 calls/s can show a 20 ms p99.

Every W7 call costs its full time limit, so W7 rows use fewer calls (``--w7-calls``), and the
naive baseline, which pays a whole interpreter start (and the numpy/sympy imports) per call,
runs ``--naive-calls`` calls per point; the ``calls`` column says how many each row used.
The machine's load average is recorded before and after each mode: on a shared machine the
figures are only as good as the quiet it had.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandbox import (  # noqa: E402
    ExecRequest,
    ExecResult,
    ExecStatus,
    HttpSandboxClient,
    LocalSandboxClient,
    PoolConfig,
)

DEFAULT_WORKLOADS = Path(__file__).resolve().parent / "tool-workloads.json"
RESULTS = ROOT / "bench" / "results" / "tool_latency.json"
RESULTS_OPEN = ROOT / "bench" / "results" / "tool_latency_open.json"


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


class NaiveClient:
    """One ``sys.executable -c`` process per call; the baseline every sandbox must beat.

    ``subprocess.run`` in a thread per concurrent call (asyncio's own subprocess support
    leaves finished processes in ``subprocess._active`` on 3.11, whose clean-up then reaps
    reused pids of later calls: "Unknown child process pid ..." and lost results)."""

    isolation = "none (naive subprocess)"

    def __init__(self, default_limit_s: float, concurrency: int = 64) -> None:
        self.default_limit_s = default_limit_s
        self.python = os.path.realpath(sys.executable)  # never a pyenv-style shell shim
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency)

    def _run(self, req: ExecRequest, limit: float) -> ExecResult:
        t0 = time.perf_counter()
        try:
            p = subprocess.run([self.python, "-c", req.code], input=req.stdin.encode(),
                               capture_output=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired:  # run() killed and reaped it
            return ExecResult(ExecStatus.TIMEOUT, "", "", -9, time.perf_counter() - t0, False)
        status = ExecStatus.OK if p.returncode == 0 else ExecStatus.ERROR
        return ExecResult(status, p.stdout.decode(errors="replace"),
                          p.stderr.decode(errors="replace"), p.returncode,
                          time.perf_counter() - t0, False)

    async def execute(self, req: ExecRequest) -> ExecResult:
        limit = req.time_limit_s or self.default_limit_s
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._run, req,
                                                                 limit)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=True)


async def closed_loop(client, req: ExecRequest, calls: int, concurrency: int):
    """``concurrency`` callers share ``calls`` calls; returns (latencies, results, wall_s)."""
    latencies: list[float] = []
    results: list[ExecResult] = []
    remaining = calls

    async def caller() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            r = await client.execute(req)
            latencies.append(time.perf_counter() - t0)
            results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(min(concurrency, calls))))
    return latencies, results, time.perf_counter() - t0


def wrong_examples(results, expect: str) -> list[str]:
    """Up to 3 distinct (status: detail) of the results whose status is not `expect`."""
    return sorted({f"{r.status}: {r.detail or r.stderr[-120:]}"
                   for r in results if r.status != expect})[:3]


def row(mode: str, wid: str, point: dict, expect: str, lat, results, wall) -> dict:
    lat = sorted(lat)
    durs = sorted(r.duration_s for r in results)
    wrong = sum(1 for r in results if r.status != expect)
    return {
        "mode": mode, "workload": wid, "point": point["name"],
        "concurrency": point["concurrency"], "calls": len(results),
        "calls_per_s": len(results) / wall if wall else float("nan"),
        "p50_ms": percentile(lat, 0.50) * 1e3, "p90_ms": percentile(lat, 0.90) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3, "max_ms": lat[-1] * 1e3 if lat else float("nan"),
        "sbx_p99_ms": percentile(durs, 0.99) * 1e3, "wrong": wrong,
        "wrong_examples": wrong_examples(results, expect),
    }


async def w7_probe(client, w7: dict, w1: dict, limit: float, concurrency: int) -> dict:
    """Time to W7's result, and W1 latency while it runs vs. alone."""
    w1_req = ExecRequest(w1["code"], w1["input"], limit)
    base_lat, _, _ = await closed_loop(client, w1_req, 200, concurrency)
    during: list[float] = []
    statuses: list[str] = []
    done = asyncio.Event()

    async def w1_caller() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            r = await client.execute(w1_req)
            during.append(time.perf_counter() - t0)
            statuses.append(str(r.status))

    callers = [asyncio.ensure_future(w1_caller()) for _ in range(concurrency)]
    t0 = time.perf_counter()
    w7_result = await client.execute(ExecRequest(w7["code"], w7["input"], limit))
    w7_s = time.perf_counter() - t0
    done.set()
    await asyncio.gather(*callers)
    base_lat.sort()
    during.sort()
    return {
        "w7_seconds": w7_s, "w7_status": str(w7_result.status), "time_limit_s": limit,
        "w1_concurrency": concurrency, "w1_calls_during": len(during),
        "w1_wrong_during": sum(1 for s in statuses if s != "ok"),
        "w1_during_p50_ms": percentile(during, 0.5) * 1e3,
        "w1_during_p99_ms": percentile(during, 0.99) * 1e3,
        "w1_alone_p50_ms": percentile(base_lat, 0.5) * 1e3,
        "w1_alone_p99_ms": percentile(base_lat, 0.99) * 1e3,
    }


async def open_loop(client, req: ExecRequest, rate: float, seconds: float, seed: int):
    """Poisson arrivals at ``rate`` calls/s for ``seconds``; returns (latencies, results,
    arrivals, span_s): latency from each call's scheduled arrival to its answer."""
    rng = random.Random(seed)
    latencies: list[float] = []
    results: list[ExecResult] = []
    tasks: set[asyncio.Task] = set()

    async def one(due: float) -> None:
        r = await client.execute(req)
        latencies.append(time.perf_counter() - due)
        results.append(r)

    start = time.perf_counter()
    due = start
    arrivals = 0
    while True:
        due += rng.expovariate(rate)
        if due - start > seconds:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(one(due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        arrivals += 1
    await asyncio.gather(*list(tasks))
    return latencies, results, arrivals, time.perf_counter() - start


async def open_loop_rows(mode: str, client, spec: dict, args) -> list[dict]:
    limit = float(spec["time_limit_s"])
    workloads = {w["id"]: w for w in spec["workloads"]}
    rows: list[dict] = []
    for wid in args.open_workloads:
        w = workloads[wid]
        req = ExecRequest(w["code"], w["input"], limit)
        _, res, wall = await closed_loop(client, req, args.capacity_calls,
                                         args.capacity_concurrency)
        capacity = len(res) / wall
        for i, frac in enumerate(args.open_loop):
            lat, results, arrivals, span = await open_loop(client, req, frac * capacity,
                                                           args.open_seconds, seed=i)
            lat.sort()
            r = {"mode": mode, "workload": wid, "fraction": frac,
                 "capacity_calls_per_s": capacity, "target_calls_per_s": frac * capacity,
                 "offered_calls_per_s": arrivals / args.open_seconds,
                 "served_calls_per_s": len(results) / span if span else float("nan"),
                 "calls": len(results), "p50_ms": percentile(lat, 0.5) * 1e3,
                 "p90_ms": percentile(lat, 0.9) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
                 "max_ms": lat[-1] * 1e3 if lat else float("nan"),
                 "wrong": sum(1 for x in results if x.status != w["expect"]),
                 "wrong_examples": wrong_examples(results, w["expect"]),
                 "load": os.getloadavg()[0]}
            rows.append(r)
            print_open_row(r)
    return rows


OPEN_HEADER = (f"{'mode':8} {'workload':11} {'frac':>4} {'capacity':>8} {'offered':>8} "
               f"{'served':>8} {'calls':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} "
               f"{'wrong':>5} {'load1':>5}")


def print_open_row(r: dict) -> None:
    print(f"{r['mode']:8} {r['workload']:11} {r['fraction']:>4.2f} "
          f"{r['capacity_calls_per_s']:>8.1f} {r['offered_calls_per_s']:>8.1f} "
          f"{r['served_calls_per_s']:>8.1f} {r['calls']:>6} {r['p50_ms']:>7.1f} "
          f"{r['p90_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} {r['wrong']:>5} "
          f"{r['load']:>5.1f}" + (f"   {r['wrong_examples']}" if r["wrong"] else ""), flush=True)


def parse_mode(mode: str) -> tuple[str, int]:
    """``http:N`` -> ("http", N); anything else -> (mode, 1)."""
    kind, _, n = mode.partition(":")
    return kind, int(n or 1)


async def start_server(workers: int, front_ends: int = 1
                       ) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--port", "0", "--workers", str(workers),
        "--front-ends", str(front_ends), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
    if not line.startswith("sandbox serving on "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split()[3]


async def run_mode(mode: str, spec: dict, args) -> tuple[list[dict], dict, dict]:
    limit = float(spec["time_limit_s"])
    workloads = {w["id"]: w for w in spec["workloads"]}
    server = None
    kind, front_ends = parse_mode(mode)
    client: LocalSandboxClient | HttpSandboxClient | NaiveClient
    if kind == "pool":
        client = LocalSandboxClient(PoolConfig(workers=args.workers))
    elif kind == "http":
        server, url = await start_server(args.workers, front_ends)
        client = HttpSandboxClient([url], batch_size=64, batch_window_ms=2.0)
    else:
        client = NaiveClient(limit)
    meta: dict = {"load_before": os.getloadavg(), "front_ends": front_ends}
    rows: list[dict] = []
    probe: dict = {}
    try:
        if not isinstance(client, NaiveClient):
            await client.__aenter__()
        meta["isolation"] = client.isolation
        warm = ExecRequest(workloads["W1-trivial"]["code"], "", limit)
        await closed_loop(client, warm, 20 if mode != "naive" else 2, 4)
        if args.open_loop:
            meta["open_rows"] = await open_loop_rows(mode, client, spec, args)
            return rows, probe, meta
        for point in spec["points"]:
            for wid, w in workloads.items():
                calls = point["calls"] if not args.quick else args.quick_calls[point["name"]]
                if w["expect"] == "timeout":
                    calls = min(calls, args.w7_calls if point["concurrency"] > 1 else 2)
                if mode == "naive":
                    calls = min(calls, args.naive_calls[point["name"]])
                req = ExecRequest(w["code"], w["input"], limit)
                lat, results, wall = await closed_loop(client, req, calls, point["concurrency"])
                rows.append(row(mode, wid, point, w["expect"], lat, results, wall))
                print_row(rows[-1])
        if mode != "naive" or not args.quick:
            probe = await w7_probe(client, workloads["W7-timeout"], workloads["W1-trivial"],
                                   limit, args.w7_concurrency)
            print(f"  W7 probe [{mode}]: W7 answered in {probe['w7_seconds']:.2f}s "
                  f"({probe['w7_status']}); W1 during: p50 {probe['w1_during_p50_ms']:.1f} "
                  f"p99 {probe['w1_during_p99_ms']:.1f} ms over {probe['w1_calls_during']} "
                  f"calls; alone: p50 {probe['w1_alone_p50_ms']:.1f} "
                  f"p99 {probe['w1_alone_p99_ms']:.1f} ms", flush=True)
    finally:
        await client.aclose()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), 60)
        meta["load_after"] = os.getloadavg()
    return rows, probe, meta


HEADER = (f"{'mode':6} {'workload':11} {'conc':>4} {'calls':>5} {'calls/s':>8} {'p50':>7} "
          f"{'p90':>7} {'p99':>7} {'max':>7} {'sbx_p99':>7} {'wrong':>5}")


def print_row(r: dict) -> None:
    print(f"{r['mode']:6} {r['workload']:11} {r['concurrency']:>4} {r['calls']:>5} "
          f"{r['calls_per_s']:>8.1f} {r['p50_ms']:>7.1f} {r['p90_ms']:>7.1f} "
          f"{r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} {r['sbx_p99_ms']:>7.1f} {r['wrong']:>5}"
          + (f"   {r['wrong_examples']}" if r["wrong"] else ""), flush=True)


async def main_async(args, spec: dict) -> dict:
    print(f"workloads: {args.workloads}  time limit {spec['time_limit_s']}s  "
          f"cpus {os.cpu_count()}  load {os.getloadavg()}  quick={args.quick}")
    if args.open_loop:
        print(f"open loop: Poisson arrivals at {args.open_loop} of each mode's closed-loop "
              f"capacity ({args.capacity_concurrency} callers, {args.capacity_calls} calls), "
              f"{args.open_seconds:g} s per point; latency in ms from scheduled arrival")
        print(OPEN_HEADER)
    else:
        print("latencies in ms, per call as the caller sees it; sbx_p99 = sandbox fork-to-exit")
        print(HEADER)
    out = {"workloads_file": str(args.workloads), "quick": args.quick,
           "python": sys.version.split()[0], "machine": platform.platform(),
           "cpus": os.cpu_count(), "workers": args.workers, "rows": [], "open_rows": [],
           "w7_probe": {}, "modes": {}, "argv": sys.argv[1:]}
    for mode in args.modes:
        rows, probe, meta = await run_mode(mode, spec, args)
        out["rows"] += rows
        out["open_rows"] += meta.pop("open_rows", [])
        out["w7_probe"][mode] = probe
        out["modes"][mode] = meta
        write_results(out, args.out)  # after each mode, so a later failure loses nothing
    return out


def write_results(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer calls: about a minute")
    p.add_argument("--workloads", default=str(DEFAULT_WORKLOADS))
    p.add_argument("--modes", default="pool,http,naive")
    p.add_argument("--workers", type=int, default=2, help="zygote workers (pool and server)")
    p.add_argument("--w7-calls", type=int, default=64, help="W7 calls at concurrency > 1")
    p.add_argument("--w7-concurrency", type=int, default=16,
                   help="W1 callers running while W7 runs in the W7 probe")
    p.add_argument("--open-loop", default="",
                   help="open loop instead: comma-separated fractions of capacity, "
                        "e.g. 0.25,0.5,0.75,0.9")
    p.add_argument("--open-workloads", default="W1-trivial,W3-sympy")
    p.add_argument("--open-seconds", type=float, default=10.0, help="duration of each point")
    p.add_argument("--capacity-concurrency", type=int, default=64)
    p.add_argument("--capacity-calls", type=int, default=2000)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/"
                                               "tool_latency.json, or _open.json)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.open_loop = [float(f) for f in args.open_loop.split(",") if f]
    args.open_workloads = [w for w in args.open_workloads.split(",") if w]
    if args.open_loop and "naive" in args.modes:
        p.error("the open loop is for pool and http modes")
    args.out = Path(args.out) if args.out else (RESULTS_OPEN if args.open_loop else RESULTS)
    args.quick_calls = {"latency-floor": 40, "saturated": 300}
    args.naive_calls = ({"latency-floor": 8, "saturated": 24} if args.quick
                        else {"latency-floor": 30, "saturated": 128})
    if args.quick:
        args.w7_calls = min(args.w7_calls, 16)
    spec = json.loads(Path(args.workloads).read_text())
    out = asyncio.run(main_async(args, spec))
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    write_results(out, args.out)
    print(f"\nwrote {args.out}; load averages: "
          + ", ".join(f"{m}: {v['load_before'][0]:.1f} -> {v['load_after'][0]:.1f}"
                      for m, v in out["modes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
