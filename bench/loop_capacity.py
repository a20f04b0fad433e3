"""Event-loop capacity: 10,000 concurrent rollouts on one loop, measured by loop lag.

The real `RolloutRunner` (scheduler, agent loop, `PythonTool`) drives 10,000 multi-turn
rollouts on 64 simulated engines that decode one token per request every ~40 ms (25 tokens/s
per rollout, a loaded GPU) and stream a delta every `--stream-interval` tokens; tool calls go to
a latency model (lognormal, median `--tool-median-s`) or, with `--real-pool`, to the real local
sandbox pool. After every rollout is admitted, loop lag (how late a 10 ms timer fires) is
recorded for `--duration` seconds; then the run is cancelled (which also exercises tearing down
10,000 rollouts).

    python bench/loop_capacity.py [--quick] [--rollouts N] [--duration S] [--stream-interval K]
                                  [--real-pool] [--stock-loop]

`--stock-loop` runs on asyncio's own loop and times every loop iteration on the thread's CPU
clock: the loop's own contribution to lag, free of other processes' load.

Prints a table, writes bench/results/loop_capacity.json. Bar: steady-state lag p99 <= 10 ms.
Loop lag is wall-clock: on a shared machine it includes time the OS gave to other processes;
the loop's own CPU share (`loop_cpu_share`) is reported beside it.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from sim_engine import (  # noqa: E402
    LagMonitor,
    SimEngine,
    SimSandbox,
    bench_tokenizer,
    loadavg,
    lognormal,
    percentile,
    turn_array,
)

from asyncrl import formats  # noqa: E402
from asyncrl.api import exact_match_reward  # noqa: E402
from asyncrl.records import Problem  # noqa: E402
from asyncrl.rollout import PythonTool, RolloutRunner, RolloutSettings  # noqa: E402
from asyncrl.rollout.eventloop import freeze_gc, loop_kind, run  # noqa: E402


class TimedLoop(asyncio.SelectorEventLoop):
    """The stock asyncio loop, timing each iteration with this thread's CPU clock.

    An iteration's CPU time is how long the loop could not serve a due timer or a ready
    callback, independent of time the OS gave to other processes: on a shared, contended
    machine it is the loop's own contribution to lag.
    """

    def __init__(self) -> None:
        super().__init__()
        self.iteration_cpu: list[float] = []
        self.record = False

    def _run_once(self) -> None:
        t = time.thread_time()
        super()._run_once()
        if self.record:
            self.iteration_cpu.append(time.thread_time() - t)


def time_weighted(xs: list[float], q: float) -> float:
    """The iteration length that a random instant of loop busy time falls within, at the
    q-th percentile (long iterations count by their length)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    total = sum(s)
    acc = 0.0
    for x in s:
        acc += x
        if acc >= total * q / 100:
            return x
    return s[-1]

FILLER = ("Let me think about the structure of this problem before writing code; the key "
          "quantity is the sum over all valid cases, which a short loop can count. ")


def make_script(tok, turns: int, median_tokens: int):
    # arrays: a turn is then an array slice plus a concatenation, done in C, so building a
    # rollout's plan on its first request costs the loop microseconds, not milliseconds
    filler = turn_array(tok.encode(FILLER * 60))
    call = turn_array(tok.encode(formats.HERMES.render_call("print(sum(range(10)))")))
    final = turn_array(tok.encode("<answer>\\boxed{45}</answer><|im_end|>"))
    plans: dict[str, list[array.array]] = {}

    def script(request) -> list[int]:
        rid, turn, _ = request.request_id.rsplit("/", 2)
        plan = plans.get(rid)
        if plan is None:
            rng = random.Random(rid)
            plan = []
            for _ in range(turns):
                n = min(1500, max(20, int(rng.lognormvariate(0, 0.6) * median_tokens)))
                start = rng.randrange(len(filler) - 1600)
                plan.append(filler[start:start + n] + call)
            plan.append(final)
            plans[rid] = plan
        n = int(turn[1:])
        return plan[n] if n < len(plan) else final

    return script


async def bench(args: argparse.Namespace, tok) -> dict:
    script = make_script(tok, args.turns, args.turn_tokens)
    engines = [SimEngine(f"sim-{i}", script, step_s=args.step_s, tokens_per_step=1,
                         stream_interval=args.stream_interval, kv_capacity=4_000_000)
               for i in range(args.engines)]
    pool_cm: contextlib.AbstractAsyncContextManager = contextlib.nullcontext()
    if args.real_pool:
        import sandbox

        pool_cm = sandbox.SandboxPool(sandbox.PoolConfig(workers=2, isolation="auto"))
    settings = RolloutSettings(max_response_tokens=16384, max_turns=args.turns + 2,
                               temperature=1.0,
                               stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
    samples = 16
    problems = [Problem(id=f"p{i}", question=f"Sum 0..9, variant {i}", answer="45")
                for i in range(args.rollouts // samples)]
    n = len(problems) * samples
    async with contextlib.AsyncExitStack() as stack:
        pool = await stack.enter_async_context(pool_cm)
        client = pool if pool is not None else SimSandbox(
            lognormal(args.tool_median_s, 0.8, random.Random(2)))
        for e in engines:
            await stack.enter_async_context(e)
        lag = await stack.enter_async_context(LagMonitor(0.01))
        runner = RolloutRunner(engines, tok, [PythonTool(client)], exact_match_reward)
        freeze_gc()  # setup done: long-lived objects out of the collector's way
        t_start = time.perf_counter()
        lag.recording = True
        groups = runner.run(problems, samples, settings, 0)
        consume = asyncio.create_task(_drain(groups))
        try:
            # ramp: until every rollout has been admitted onto an engine
            while True:
                await asyncio.sleep(0.25)
                sched = runner.last_scheduler
                if (sched is not None and sched.admitted >= n) or time.perf_counter() - t_start > 300:
                    break
            ramp_s = time.perf_counter() - t_start
            ramp_lags = list(lag.lags)
            lag.lags.clear()
            loop = asyncio.get_running_loop()
            if isinstance(loop, TimedLoop):
                loop.record = True
            d0 = sum(e.deltas for e in engines)
            k0 = sum(e.tokens for e in engines)
            c0, w0 = time.thread_time(), time.perf_counter()  # the loop's thread only
            calls0 = _calls(client)
            await asyncio.sleep(args.duration)
            wall = time.perf_counter() - w0
            cpu = time.thread_time() - c0
            iters = list(loop.iteration_cpu) if isinstance(loop, TimedLoop) else []
            if isinstance(loop, TimedLoop):
                loop.record = False
            steady = list(lag.lags)
            active_end = sum(len(e._active) for e in engines)
            deltas = sum(e.deltas for e in engines) - d0
            tokens = sum(e.tokens for e in engines) - k0
            calls = _calls(client) - calls0
        finally:
            lag.recording = False
            t_cancel = time.perf_counter()
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            await groups.aclose()
            cancel_s = time.perf_counter() - t_cancel
        ms = 1e3
        out = {
            "bench": "loop_capacity",
            "loop": "asyncio (timed iterations)" if iters else loop_kind(),
            "python": platform.python_version(),
            "rollouts": n,
            "engines": args.engines,
            "in_flight_at_end": active_end,
            "tool": "real pool" if args.real_pool else f"lognormal median {args.tool_median_s}s",
            "engine_settings": {"step_s": args.step_s, "tokens_per_rollout_per_s": round(1 / args.step_s, 1),
                                "stream_interval": args.stream_interval,
                                "median_turn_tokens": args.turn_tokens, "tool_turns": args.turns},
            "ramp_s": round(ramp_s, 2),
            "ramp_lag_ms": {"p99": round(percentile(ramp_lags, 99) * ms, 2),
                            "max": round(percentile(ramp_lags, 100) * ms, 2)},
            "steady_s": round(wall, 2),
            "lag_ms": {q: round(percentile(steady, p) * ms, 2)
                       for q, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
            "lag_samples": len(steady),
            "loop_cpu_share": round(cpu / wall, 3),
            "cpu_us_per_delta": round(cpu / max(1, deltas) * 1e6, 1),
            "iteration_cpu_ms": ({"p50": round(percentile(iters, 50) * ms, 3),
                                  "p99_time_weighted": round(time_weighted(iters, 99) * ms, 3),
                                  "max": round(max(iters) * ms, 3), "iterations": len(iters)}
                                 if iters else None),
            "deltas_per_s": round(deltas / wall),
            "tokens_per_s": round(tokens / wall),
            "tool_calls_per_s": round(calls / wall, 1),
            "cancel_all_s": round(cancel_s, 2),
            "bar": {"lag_p99_ms_max": 10.0, "pass": percentile(steady, 99) * ms <= 10.0},
        }
    return out


def _calls(client) -> int:
    """Tool calls so far: the latency model counts them, the real pool in its metrics."""
    metrics = getattr(client, "metrics", None)
    if metrics is not None:
        return int(sum(metrics.calls.values()))
    return int(client.calls)


async def _drain(groups) -> None:
    async for _ in groups:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2,000 rollouts, 8 s window")
    ap.add_argument("--rollouts", type=int, default=10_000)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--duration", type=float, default=30.0, help="steady-state window, seconds")
    ap.add_argument("--step-s", type=float, default=0.04, help="simulated decode step")
    ap.add_argument("--stream-interval", type=int, default=16, help="tokens per delta")
    ap.add_argument("--turns", type=int, default=8, help="tool-call turns per rollout")
    ap.add_argument("--turn-tokens", type=int, default=300, help="median tokens per turn")
    ap.add_argument("--tool-median-s", type=float, default=0.1)
    ap.add_argument("--real-pool", action="store_true", help="tool calls to the real local pool")
    ap.add_argument("--stock-loop", action="store_true",
                    help="run on the stock asyncio loop and time each iteration's CPU")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "loop_capacity.json"))
    args = ap.parse_args()
    if args.quick:
        args.rollouts, args.duration = min(args.rollouts, 2000), min(args.duration, 8.0)
    tok = bench_tokenizer()  # setup (loads transformers) before the loop, then frozen
    load_before = loadavg()
    if args.stock_loop:
        freeze_gc()  # as `run` does for uvloop
        with asyncio.Runner(loop_factory=TimedLoop) as runner:
            res = runner.run(bench(args, tok))
    else:
        res = run(bench(args, tok))
    res["loadavg_1m"] = {"before": load_before, "after": loadavg(), "cpus": os.cpu_count()}
    print(f"event-loop capacity ({res['loop']}): {res['rollouts']} concurrent rollouts on "
          f"{res['engines']} simulated engines, tools: {res['tool']}")
    print(f"  ramp to all admitted: {res['ramp_s']} s (lag p99 {res['ramp_lag_ms']['p99']} ms, "
          f"max {res['ramp_lag_ms']['max']} ms)")
    print(f"  steady {res['steady_s']} s: {res['deltas_per_s']} deltas/s, {res['tokens_per_s']} "
          f"tokens/s, {res['tool_calls_per_s']} tool calls/s, loop CPU share "
          f"{res['loop_cpu_share']}")
    lag = res["lag_ms"]
    print(f"  {'loop lag':<12}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    print(f"  {'steady':<12}{lag['p50']:>9}{lag['p90']:>9}{lag['p99']:>9}{lag['max']:>9}")
    if res["iteration_cpu_ms"]:
        it = res["iteration_cpu_ms"]
        print(f"  loop iteration CPU time: p50 {it['p50']} ms, time-weighted p99 "
              f"{it['p99_time_weighted']} ms, max {it['max']} ms ({it['iterations']} iterations)")
    print(f"  loop CPU per delta: {res['cpu_us_per_delta']} us")
    print(f"  cancelling all in-flight rollouts took {res['cancel_all_s']} s")
    print(f"  machine load average (1 min) before/after: {res['loadavg_1m']['before']} / "
          f"{res['loadavg_1m']['after']} on {res['loadavg_1m']['cpus']} CPUs")
    print(f"bar lag p99 <= 10 ms: {'PASS' if res['bar']['pass'] else 'FAIL'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
