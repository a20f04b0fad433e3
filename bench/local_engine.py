"""The in-process engine (`engine.kind = "local"`) against `model.generate` on the same model.

For each model and stream count: N requests of a 256-token random prompt and 256 new tokens at
temperature 1.0 (no stop), all submitted at once to one `LocalEngine`, once per decode path
(`--arms`: `eager`, the growing left-padded cache; `static`, the fixed-shape step, captured as
CUDA graphs on CUDA), against one `model.generate(do_sample=True, temperature=1.0, top_k=0)`
call over the same N prompts (left-padded batch: what a user without an engine would write).
Each engine first serves the same N prompts for 8 tokens (its warm-up: CUDA context, kernels,
the static path's graph for that shape), then the timed batch; `generate` is warmed up once per
model. Prints a table of tokens/s and the ratios, writes `bench/results/local_engine.json`.

Equality, in the same run: the N prompts, greedy, `--check-new` tokens, through every arm and
`generate`, in fp32 (a copy of a bf16 model: in bf16 near-tied logits flip under the arms'
different kernels); a row counts the streams whose tokens equal across arms, and seeded
sampling (temperature 1, a seed per stream) between the two engine paths.

Models:
- `tiny`: the tiny curriculum's model (`curricula/tiny.toml`'s `model.init`, 1,024-token vocab);
- `qwen3-vocab`: Qwen3 shapes scaled down to run on a CPU (hidden 128, 4 layers) with the real
  151,936-token vocabulary, where sampling over the vocabulary is most of a step;
- `qwen3-0.6b` (`--device cuda` only): Qwen3-0.6B shapes in bf16, random init.

    python bench/local_engine.py [--models tiny qwen3-vocab] [--streams 1 16 64 256]
                                 [--prompt 256] [--new 256] [--device cpu] [--quick]
                                 [--arms eager static] [--check-new 16]

`--quick` runs 16 and 64 streams with 64 new tokens. Weights are random: the point is the speed
of the generation machinery, which does not depend on what the model says.

`--split` times the static arm a second time (the first stays unperturbed) with timers on the
engine's parts and reports, per step, the device's share (on CUDA the graph replay,
synchronised), the host's preparation, the rest of the forward thread, prefill and the event
loop (`StepSplit`): whether the host or the GPU bounds a step.

`--churn` adds the RL shape, engine only (`generate` cannot serve it): each stream runs
`--turns` requests one after the other, each a continuation of the last (its context plus a
16-token "tool output"), with new-token counts drawn from 16..`--new`, so rows leave and join
the running batch all the time. Tokens/s counts generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.engine.base import GenerateRequest, SamplingParams, collect  # noqa: E402
from asyncrl.engine.local.engine import DECODES, LocalEngine  # noqa: E402
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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class StepSplit:
    """Where the timed batch's time went, per engine step (`--split`): the engine's methods
    wrapped with timers while the block runs. `device_ms`: the static path's step from its
    inputs to its outputs (on CUDA the graph's replay, synchronised); `host_prep_ms`: the rest
    of the static `decode` (inputs to fixed buffers, draws, the copy back); `thread_ms`: the
    rest of the forward thread's step (the plan's row operations, stop checks; the eager path's
    whole forward and sampling); `prefill_ms`: prefills; `loop_ms`: the event loop between
    steps (planning, handing out tokens, the consumers, the thread hand-off). They add up to
    the wall time."""

    def __init__(self, device: str) -> None:
        from asyncrl.engine.local import static

        self._targets = [(LocalEngine, "_step"), (LocalEngine, "_prefill"),
                         (static.StaticBatch, "decode"), (static.StaticBatch, "_replay"),
                         (static.StaticBatch, "_step")]
        self._cuda = device == "cuda"
        self.t: dict[str, float] = {}
        self._saved: list = []
        self._depth = 0

    def __enter__(self) -> StepSplit:
        for cls, name in self._targets:
            fn = getattr(cls, name)
            self._saved.append((cls, name, fn))
            setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)

    def _wrap(self, key: str, fn):
        split = self
        device_side = key in ("StaticBatch._replay", "StaticBatch._step")

        def timed(*args, **kwargs):
            # `_step` runs inside `_replay` when it captures: only the outermost call counts,
            # and only it synchronises (never inside a graph capture)
            outer = not device_side or split._depth == 0
            split._depth += device_side
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if device_side and outer and split._cuda:
                    torch.cuda.synchronize()
                return out
            finally:
                split._depth -= device_side
                if outer:
                    split.t[key] = split.t.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def per_step(self, wall_s: float, steps: int) -> dict[str, float]:
        t = self.t
        device = t.get("StaticBatch._replay", 0.0) + t.get("StaticBatch._step", 0.0)
        parts = {"device_ms": device,
                 "host_prep_ms": t.get("StaticBatch.decode", 0.0) - device,
                 "prefill_ms": t.get("LocalEngine._prefill", 0.0),
                 "thread_ms": (t.get("LocalEngine._step", 0.0) - t.get("StaticBatch.decode", 0.0)
                               - t.get("LocalEngine._prefill", 0.0)),
                 "loop_ms": wall_s - t.get("LocalEngine._step", 0.0)}
        return {k: round(v * 1e3 / max(steps, 1), 3) for k, v in parts.items()}


def run_engine(model, tok, ps: list[list[int]], new: int, device: str, decode: str = "eager",
               warm: int = 8, split: bool = False) -> tuple[float, int, int, dict | None]:
    """Tokens/s of one engine over `ps` (after a `warm`-token pass over the same prompts), its
    decode steps, the CUDA graphs it captured, and with `split` where each step's time went
    (`StepSplit.per_step`; the timers' own cost is in it)."""
    async def go() -> tuple[float, int, int, dict | None]:
        budget = len(ps) * (len(ps[0]) + new) + 64
        async with LocalEngine(model, tok, kv_token_budget=budget, max_running=len(ps),
                               device=device, decode=decode) as eng:
            if warm:
                await asyncio.gather(*(collect(eng, GenerateRequest(
                    request_id=f"w{i}", input_ids=p,
                    sampling=SamplingParams(max_new_tokens=warm, temperature=1.0)))
                    for i, p in enumerate(ps)))
            steps0 = eng.steps
            timer = StepSplit(device) if split else contextlib.nullcontext()
            _sync(device)
            with timer:
                t0 = time.perf_counter()
                gens = await asyncio.gather(*(collect(eng, GenerateRequest(
                    request_id=f"r{i}", input_ids=p,
                    sampling=SamplingParams(max_new_tokens=new, temperature=1.0)))
                    for i, p in enumerate(ps)))
                _sync(device)
                dt = time.perf_counter() - t0
            steps = eng.steps - steps0
            captures = getattr(eng._batch, "captures", 0)
        assert all(len(g.token_ids) == new for g in gens)
        parts = timer.per_step(dt, steps) if isinstance(timer, StepSplit) else None
        return sum(len(g.token_ids) for g in gens) / dt, steps, captures, parts

    return asyncio.run(go())


def engine_tokens(model, tok, ps: list[list[int]], new: int, device: str, decode: str,
                  **sp) -> list[list[int]]:
    """Each prompt's tokens from one engine (all submitted at once)."""
    async def go() -> list[list[int]]:
        budget = len(ps) * (len(ps[0]) + new) + 64
        async with LocalEngine(model, tok, kv_token_budget=budget, max_running=len(ps),
                               device=device, decode=decode) as eng:
            gens = await asyncio.gather(*(collect(eng, GenerateRequest(
                request_id=f"q{i}", input_ids=p, sampling=SamplingParams(
                    max_new_tokens=new, **{k: (v + i if k == "seed" else v)
                                           for k, v in sp.items()})))
                for i, p in enumerate(ps)))
        return [g.token_ids for g in gens]

    return asyncio.run(go())


def check_equal(model, tok, ps: list[list[int]], new: int, device: str,
                arms: list[str]) -> dict:
    """Greedy tokens of every arm and `generate`, and seeded samples of the engine arms, on
    the same prompts in fp32: how many streams agree."""
    m = model if next(model.parameters()).dtype == torch.float32 else (
        copy.deepcopy(model).float())
    with torch.inference_mode():
        ids = torch.tensor(ps, device=device)
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = out[:, len(ps[0]):].tolist()
    greedy = {a: engine_tokens(m, tok, ps, new, device, a, temperature=0.0) for a in arms}
    res: dict = {"streams": len(ps), "new": new, "dtype": "float32"}
    for a in arms:
        res[f"{a}_eq_generate"] = sum(x == y for x, y in zip(greedy[a], ref, strict=True))
    if "eager" in arms and "static" in arms:
        res["static_eq_eager"] = sum(x == y for x, y in zip(greedy["static"], greedy["eager"],
                                                            strict=True))
        seeded = {a: engine_tokens(m, tok, ps, new, device, a, temperature=1.0, seed=1000)
                  for a in ("eager", "static")}
        res["seeded_static_eq_eager"] = sum(
            x == y for x, y in zip(seeded["static"], seeded["eager"], strict=True))
    if m is not model:
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
    return res


def run_churn(model, tok, n: int, prompt: int, new: int, turns: int, vocab: int,
              device: str, decode: str = "eager") -> tuple[float, int]:
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
                               device=device, decode=decode) as eng:
            t0 = time.perf_counter()
            made = await asyncio.gather(*(stream(eng, i, p)
                                          for i, p in enumerate(prompts(n, prompt, vocab))))
            return sum(made) / (time.perf_counter() - t0), eng.steps

    return asyncio.run(go())


def header(arms: list[str]) -> str:
    """The table's header line: one speed and one ratio column per decode arm."""
    heads = "".join(f" {arm + ' tok/s':>13}" for arm in arms)
    ratios = "".join(f" {arm + '/gen':>10}" for arm in arms)
    return (f"{'model':<12} {'streams':>7}{heads} {'generate tok/s':>15}{ratios} {'steps':>6}"
            f" {'equal':>10}")


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
    p.add_argument("--arms", nargs="+", default=["eager", "static"],
                   choices=list(DECODES), help="the engine's decode paths to time")
    p.add_argument("--check-new", type=int, default=16,
                   help="greedy tokens per stream of the equality check (0: no check)")
    p.add_argument("--split", action="store_true",
                   help="time the static arm a second time with timers on the engine's parts "
                        "(StepSplit): device, host prep, forward thread, prefill, event loop")
    p.add_argument("--out", default=str(RESULTS / "local_engine.json"))
    a = p.parse_args()
    models = a.models or (["tiny", "qwen3-vocab"] + (["qwen3-0.6b"] if a.device == "cuda" else []))
    streams = a.streams or ([16, 64] if a.quick else [1, 16, 64, 256])
    new = a.new or (64 if a.quick else 256)
    tok = train_tokenizer(["What is 12 plus 7? print(12 + 7)"] * 20, vocab_size=300)
    rows = []
    print(header(a.arms), flush=True)
    for name in models:
        model = build(name, a.device)
        # Warm `generate` up first (CUDA context, kernels picked, allocator pools); each engine
        # warms itself up on its own prompts (`run_engine`).
        run_generate(model, prompts(4, a.prompt, SHAPES[name]["vocab_size"]), 8, a.device)
        for n in streams:
            ps = prompts(n, a.prompt, SHAPES[name]["vocab_size"])
            row: dict = dict(model=name, streams=n, prompt=a.prompt, new=new, arms=a.arms)
            for arm in a.arms:
                tps, steps, caps, parts = run_engine(model, tok, ps, new, a.device, arm)
                row.update({f"{arm}_tps": tps, f"{arm}_steps": steps,
                            **({"static_captures": caps} if arm == "static" else {})})
                if a.split and arm == "static":  # a second pass, with timers (StepSplit)
                    parts = run_engine(model, tok, ps, new, a.device, arm, split=True)[3]
                    row[f"{arm}_split"] = parts
                    print(f"  {arm} per step: " + ", ".join(f"{k} {v:.2f}"
                                                           for k, v in parts.items()),
                          flush=True)
            gen_tps = run_generate(model, ps, new, a.device)
            row["generate_tps"] = gen_tps
            for arm in a.arms:
                row[f"{arm}_ratio"] = row[f"{arm}_tps"] / gen_tps
            if "eager" in a.arms:  # the names earlier readers know
                row.update(engine_tps=row["eager_tps"], ratio=row["eager_ratio"],
                           engine_steps=row["eager_steps"])
            if a.check_new:
                row["equal"] = check_equal(model, tok, ps, a.check_new, a.device, a.arms)
            row["loadavg"] = os.getloadavg()[0]
            rows.append(row)
            eq = row.get("equal", {})
            eq_s = (f"{eq.get('static_eq_eager', '-')}/{n}" if eq else "-")
            print(f"{name:<12} {n:>7}" + "".join(f" {row[f'{arm}_tps']:>13.0f}"
                                                  for arm in a.arms)
                  + f" {gen_tps:>15.0f}" + "".join(f" {row[f'{arm}_ratio']:>10.2f}"
                                                   for arm in a.arms)
                  + f" {row[f'{a.arms[-1]}_steps']:>6} {eq_s:>10}", flush=True)
            if a.churn:
                for arm in a.arms:
                    tps, steps = run_churn(model, tok, n, a.prompt, new, a.turns,
                                           SHAPES[name]["vocab_size"], a.device, arm)
                    rows.append(dict(model=name, streams=n, prompt=a.prompt, new=new,
                                     turns=a.turns, workload="churn", arm=arm,
                                     engine_tps=tps, engine_steps=steps))
                    print(f"{name:<12} {n:>7} {tps:>13.0f} (churn, {arm}) {steps:>6}",
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
