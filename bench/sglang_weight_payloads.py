"""Cost of SGLang tensor weight payloads on this machine: one serialisation per TP rank.

SGLang 0.5.23's rank r unpickles element r of `serialized_named_tensors`, so the engine
serialises every bucket once per rank (`asyncrl/engine/sglang/weights.py`). This measures what
that costs for CPU tensors (the FSDP sync dict; CUDA tensors travel as IPC handles and cost
far less), and a whole tensor update through the engine against the fake server running as
its own process, as a real one does (session, payloads over HTTP, each rank's unpickling,
version tag), for TP sizes 1, 2 and 4.

    python bench/sglang_weight_payloads.py [--mb 256] [--tensors 16] [--repeats 3]

Prints a table and writes bench/results/sglang_weight_payloads.json (or `--out`). Timings are
wall-clock on this machine, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
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
from asyncrl.engine.sglang.engine import SGLangEngine  # noqa: E402
from asyncrl.engine.sglang.weights import rank_payloads  # noqa: E402


def state(mb: int, n: int) -> dict[str, torch.Tensor]:
    per = mb * (1 << 20) // 4 // n
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


async def update_once(fake: FakeProcess, sd: dict[str, torch.Tensor], tp: int,
                      version: int) -> float:
    opts = RemoteOptions(weight_timeout_s=600.0, health_interval_s=5.0)
    await fake.reset()
    async with aiohttp.ClientSession() as http, \
            SGLangEngine(SGLangEngineConfig(tp_size=tp), index=0, session=http, url=fake.url,
                         options=opts) as eng:
        t0 = time.perf_counter()
        await eng.update_weights(WeightUpdate(version=version, state_dict=sd))
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="state dict size, MiB (float32)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/sglang_weight_payloads.json")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for tp in (1, 2, 4):
        ser, upd = [], []
        with FakeProcess("sglang_server.py", "--model-path", "/fake/model", "--tp-size",
                         str(tp), startup_timeout_s=60.0) as fake:
            for r in range(args.repeats):
                sd = state(args.mb, args.tensors)  # fresh tensors: first share_memory_ included
                t0 = time.perf_counter()
                rank_payloads(list(sd.items()), tp)
                ser.append(time.perf_counter() - t0)
                upd.append(asyncio.run(update_once(fake, state(args.mb, args.tensors), tp,
                                                   r + 1)))
        rows.append({"tp": tp, "mb": args.mb, "serialize_s": min(ser), "update_s": min(upd)})
    print(f"{'tp':>3} {'MiB':>6} {'serialise all ranks (s)':>24} {'update via fake (s)':>20}")
    for x in rows:
        print(f"{x['tp']:>3} {x['mb']:>6} {x['serialize_s']:>24.3f} {x['update_s']:>20.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                               "machine": platform.platform(), "argv": sys.argv}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
