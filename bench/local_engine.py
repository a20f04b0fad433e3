"""The in-process engine (`engine.kind = "local"`) against `model.generate` on the same model.

For each model and stream count: N requests of a 256-token random prompt and 256 new tokens at
temperature 1.0 (no stop), all submitted at once to one `LocalEngine` (after a short warm-up
of both), against one
`model.generate(do_sample=True, temperature=1.0, top_k=0)` call over the same N prompts
(left-padded batch: what a user without an engine would write). Prints a table of tokens/s and
the ratio, writes `bench/results/local_engine.json`.

Models:
- `tiny`: the tiny curriculum's model (`curricula/tiny.toml`'s `model.init`, 1,024-token vocab);
- `qwen3-vocab`: Qwen3 shapes scaled down to run on a CPU (hidden 128, 4 layers) with the real
  151,936-token vocabulary, where sampling over the vocabulary is most of a step;
- `qwen3-0.6b` (`--device cuda` only): Qwen3-0.6B shapes in bf16, random init.

    python bench/local_engine.py [--models tiny qwen3-vocab] [--streams 1 16 64 256]
                                 [--prompt 256] [--new 256] [--device cpu] [--quick]

`--quick` runs 16 and 64 streams with 64 new tokens. Weights are random: the point is the speed
of the generation machinery, which does not depend on what the model says.

`--churn` adds the RL shape, engine only (`generate` cannot serve it): each stream runs
`--turns` requests one after the other, each a continuation of the last (its context plus a
16-token "tool output"), with new-token counts drawn from 16..`--new`, so rows leave and join
the running batch all the time. Tokens/s counts generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.engine.base import GenerateRequest, SamplingParams, collect  # noqa: E402
from asyncrl.engine.local.engine import LocalEngine  # noqa: E402
from asyncrl.modeling import train_tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results"

SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024),
    "qwen3-vocab": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936),
}


def build(name: str, device: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[name], max_position_embeddings=4096, rope_theta=1e6,
                      tie_word_embeddings=name != "qwen3-0.6b")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    dtype = torch.bfloat16 if name == "qwen3-0.6b" else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(10, min(vocab, 1000), (n, length), generator=g).tolist()


def run_generate(model, ps: list[list[int]], new: int, device: str) -> float:
    ids = torch.tensor(ps, device=device)
    mask = torch.ones_like(ids)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=0, eos_token_id=None)
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert out.shape[1] == len(ps[0]) + new
    return len(ps) * new / dt


def run_engine(model, tok, ps: list[list[int]], new: int, device: str) -> tuple[float, int]:
    async def go() -> tuple[float, int]:
        budget = len(ps) * (len(ps[0]) + new) + 64
        async with LocalEngine(model, tok, kv_token_budget=budget, max_running=len(ps),
                               device=device) as eng:
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(collect(eng, GenerateRequest(
                request_id=f"r{i}", input_ids=p,
                sampling=SamplingParams(max_new_tokens=new, temperature=1.0)))
                for i, p in enumerate(ps)))
            dt = time.perf_counter() - t0
            steps = eng.steps
        assert all(len(g.token_ids) == new for g in gens)
        return sum(len(g.token_ids) for g in gens) / dt, steps

    return asyncio.run(go())


def run_churn(model, tok, n: int, prompt: int, new: int, turns: int, vocab: int,
              device: str) -> tuple[float, int]:
    g = torch.Generator().manual_seed(1)
    budget = n * (prompt + turns * (new + 16)) + 64

    async def stream(eng: LocalEngine, i: int, ctx: list[int]) -> int:
        made = 0
        for t in range(turns):
            want = int(torch.randint(16, new + 1, (1,), generator=g))
            out = await collect(eng, GenerateRequest(
                request_id=f"s{i}t{t}", input_ids=ctx,
                sampling=SamplingParams(max_new_tokens=want, temperature=1.0)))
            made += len(out.token_ids)
            ctx = ctx + out.token_ids + torch.randint(10, 1000, (16,), generator=g).tolist()
        return made

    async def go() -> tuple[float, int]:
        async with LocalEngine(model, tok, kv_token_budget=budget, max_running=n,
                               device=device) as eng:
            t0 = time.perf_counter()
            made = await asyncio.gather(*(stream(eng, i, p)
                                          for i, p in enumerate(prompts(n, prompt, vocab))))
            return sum(made) / (time.perf_counter() - t0), eng.steps

    return asyncio.run(go())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--streams", nargs="+", type=int, default=None)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="16 and 64 streams, 64 new tokens")
    p.add_argument("--churn", action="store_true", help="also the multi-turn churn workload")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "local_engine.json"))
    a = p.parse_args()
    models = a.models or (["tiny", "qwen3-vocab"] + (["qwen3-0.6b"] if a.device == "cuda" else []))
    streams = a.streams or ([16, 64] if a.quick else [1, 16, 64, 256])
    new = a.new or (64 if a.quick else 256)
    tok = train_tokenizer(["What is 12 plus 7? print(12 + 7)"] * 20, vocab_size=300)
    rows = []
    print(f"{'model':<12} {'streams':>7} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6}"
          f" {'steps':>6}", flush=True)
    for name in models:
        model = build(name, a.device)
        # Warm both up first (CUDA context, kernels picked, allocator pools) so that neither
        # pays for starting up inside its timed run; the engine used to run first, cold.
        warm = prompts(4, a.prompt, SHAPES[name]["vocab_size"])
        run_engine(model, tok, warm, 8, a.device)
        run_generate(model, warm, 8, a.device)
        for n in streams:
            ps = prompts(n, a.prompt, SHAPES[name]["vocab_size"])
            eng_tps, steps = run_engine(model, tok, ps, new, a.device)
            gen_tps = run_generate(model, ps, new, a.device)
            row = dict(model=name, streams=n, prompt=a.prompt, new=new, engine_tps=eng_tps,
                       generate_tps=gen_tps, ratio=eng_tps / gen_tps, engine_steps=steps)
            rows.append(row)
            print(f"{name:<12} {n:>7} {eng_tps:>13.0f} {gen_tps:>15.0f} {row['ratio']:>6.2f}"
                  f" {steps:>6}", flush=True)
            if a.churn:
                tps, steps = run_churn(model, tok, n, a.prompt, new, a.turns,
                                       SHAPES[name]["vocab_size"], a.device)
                rows.append(dict(model=name, streams=n, prompt=a.prompt, new=new, turns=a.turns,
                                 workload="churn", engine_tps=tps, engine_steps=steps))
                print(f"{name:<12} {n:>7} {tps:>13.0f} {'(churn)':>15} {'':>6} {steps:>6}",
                      flush=True)
        del model
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=a.device, torch=torch.__version__, threads=torch.get_num_threads(),
                loadavg=os.getloadavg(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
