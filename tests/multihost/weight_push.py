"""Trainer rank 0's side of a distributed weight push, as a program for one host of the
multi-host tests: `python weight_push.py URL [--hold-at-bucket N]`.

Attaches to the SGLang fake at URL (on another host), forms the weight-update group with it
(`asyncrl.weightsync.group.WeightGroup`, the master address found from the route to the
server), pushes a state dict in several buckets twice, and prints one JSON line: each push's
failures, seconds, the address the server was told, and whether the server holds exactly the
tensors sent. With `--hold-at-bucket N` the second push prints `holding N` before
broadcasting its N-th bucket and waits for a line on stdin (the test cuts the link then).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
import torch

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.remote.options import RemoteOptions
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.weightsync import group as wg

OPTS = RemoteOptions(health_interval_s=0.2, health_timeout_s=2.0, health_failures=2,
                     control_timeout_s=2.0, weight_timeout_s=6.0, load_ttl_s=0.0,
                     startup_timeout_s=20.0)


BUCKETS = 4
"""Four 16 KiB tensors in buckets of 20 KiB: one bucket each."""


def state(scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer.{i}.weight": torch.randn(64, 64, generator=g) * scale
            for i in range(BUCKETS)}


def holding(send: Any, hold: int) -> Any:
    """`send`, except that the second push's `hold`-th bucket waits for a line on stdin
    (announced as `holding N`)."""
    n = [0]

    def held(backend: Any, bucket: Any, device: Any) -> None:
        n[0] += 1
        if n[0] == BUCKETS + hold:  # push 1 sent its BUCKETS first
            print(f"holding {hold}", flush=True)
            sys.stdin.readline()
        send(backend, bucket, device)
    return held


async def warm_up(http: aiohttp.ClientSession, url: str) -> None:
    """Have the fake import torch (a real server has it loaded; the import blocks the fake's
    event loop for seconds on a busy machine): an NCCL call it answers after its dtype check,
    on a group it does not have, inside a session."""
    for path, body in (("/begin_weight_update", {"selector": "all"}),
                       ("/update_weights_from_distributed", {
                           "names": [], "dtypes": [], "shapes": [], "group_name": "warm-up"}),
                       ("/end_weight_update", {})):
        async with http.post(url + path, json=body) as r:
            await r.read()


async def main(url: str, hold: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        eng = SGLangEngine(SGLangEngineConfig(weight_sync="distributed"), index=0,
                           session=http, url=url, model_path="/fake/model", options=OPTS)
        await warm_up(http, url)  # before the engine's health checks start
        async with eng, wg.WeightGroup(bucket_bytes=20 << 10) as group:
            if hold:
                wg._send_bucket = holding(wg._send_bucket, hold)  # type: ignore[assignment]
            for version, scale in ((1, 1.0), (2, 2.0)):
                sent = state(scale)
                t0 = time.monotonic()
                failed = await group.push([eng], sent, version)
                took = time.monotonic() - t0
                st: dict[str, Any] = {"attrs": {}, "calls": {}}
                if not failed:
                    async with http.get(url + "/_fake/state", timeout=aiohttp.ClientTimeout(5),
                                        params={"get": "received,core.weight_version"}) as r:
                        st = await r.json()
                got = st["attrs"].get("received", {})
                out[f"push{version}"] = {
                    "failed": [[n, str(e)] for n, e in failed], "seconds": round(took, 3),
                    "exact": set(got) == set(sent) and all(
                        torch.equal(torch.tensor(got[k]), v) for k, v in sent.items()),
                    "server_version": st["attrs"].get("core.weight_version"),
                    "engine_version": eng.policy_version, **group.last_push}
                inits = st["calls"].get("/init_weights_update_group", [])
                if inits:
                    out["master_address"] = inits[0]["master_address"]
            out["healthy"] = eng.healthy
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--hold-at-bucket", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main(args.url, args.hold_at_bucket))), flush=True)
