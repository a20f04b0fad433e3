"""Cost of a distributed weight push against a tensor push, on this machine.

The state dict of the tiny curriculum's model (`curricula/tiny.toml`'s Qwen3, float32) goes to
the fake SGLang server running as its own process, once by `weight_sync = "tensor"`
(serialised by value, one HTTP call per bucket) and once by `"distributed"` (a gloo group of
trainer rank 0 and the server, `asyncrl/weightsync/group.py`; the group is formed by the
first push, which is timed apart). Both go through the whole update sequence (pause, session,
calls, version, resume), in buckets of 512 KiB each (the fake's HTTP front takes bodies of at
most 1 MiB, and a tensor payload is its bytes plus a third in base64).

    python bench/sglang_weight_group.py [--repeats 5] [--scale 1]

`--scale k` multiplies hidden and intermediate sizes by k. Prints a table and writes
bench/results/sglang_weight_group.json (or `--out`); timings are wall-clock, best and median
of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "tests")]

import aiohttp  # noqa: E402
import torch  # noqa: E402
from fakes.control import FakeProcess  # noqa: E402

from asyncrl.config import SGLangEngineConfig  # noqa: E402
from asyncrl.engine.base import WeightUpdate  # noqa: E402
from asyncrl.engine.remote.engine import RemoteOptions  # noqa: E402
from asyncrl.engine.sglang import weights as sglang_weights  # noqa: E402
from asyncrl.engine.sglang.engine import SGLangEngine  # noqa: E402
from asyncrl.weightsync.group import WeightGroup  # noqa: E402


def tiny_state(scale: int) -> dict[str, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=1024, hidden_size=128 * scale,
                      intermediate_size=384 * scale, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32 * scale,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Qwen3ForCausalLM(cfg).state_dict().items()}


BUCKET = 512 << 10


async def measure(url: str, sd: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    sglang_weights.TENSOR_BUCKET_BYTES = BUCKET  # type: ignore[misc]
    opts = RemoteOptions(weight_timeout_s=120.0, health_interval_s=5.0)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        async with SGLangEngine(SGLangEngineConfig(), index=0, session=http, url=url,
                                options=opts) as eng, WeightGroup(bucket_bytes=BUCKET) as group:
            times = []
            for v in range(repeats):
                t0 = time.perf_counter()
                await eng.update_weights(WeightUpdate(version=v + 1, state_dict=sd))
                times.append(time.perf_counter() - t0)
            out["tensor"] = times
            t0 = time.perf_counter()
            assert await group.push([eng], sd, 100) == []
            out["distributed_first"] = time.perf_counter() - t0
            times = []
            for v in range(repeats):
                t0 = time.perf_counter()
                assert await group.push([eng], sd, 101 + v) == []
                times.append(time.perf_counter() - t0)
            out["distributed"] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--out", default="bench/results/sglang_weight_group.json")
    args = ap.parse_args()
    sd = tiny_state(args.scale)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model") as fake:
        res = asyncio.run(measure(fake.url, sd, args.repeats))
    rows = {k: {"best_ms": round(min(v) * 1e3, 1), "median_ms": round(statistics.median(v)
                                                                         * 1e3, 1)}
            for k, v in res.items() if isinstance(v, list)}
    print(f"state dict: {len(sd)} tensors, {nbytes} bytes ({nbytes / 2**20:.2f} MiB)")
    print(f"{'path':<14}{'best ms':>10}{'median ms':>12}")
    for k, r in rows.items():
        print(f"{k:<14}{r['best_ms']:>10}{r['median_ms']:>12}")
    print(f"{'group formed':<14}{res['distributed_first'] * 1e3:>10.1f}   (first push)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.platform(), "cpus": __import__("os").cpu_count(),
        "tensors": len(sd), "bytes": nbytes, "bucket_bytes": BUCKET, "repeats": args.repeats, "scale": args.scale,
        "rows": rows, "distributed_first_ms": round(res["distributed_first"] * 1e3, 1)},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
