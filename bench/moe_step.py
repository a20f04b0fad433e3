"""Routing replay's effect on the RL step of a mixture-of-experts model, on the CPU: how close
the trainer's log-probs of the sampled tokens come to the engine's with and without replay,
at a chosen routing shape and engine precision, and the step's time.

The model is `curricula/tiny-moe.toml`'s Qwen3-MoE (random weights), its routing shape
optionally changed (`--experts`, `--top-k`, `--layers`, `--expert-width`; the hidden size
stays 128 so that a 30B-A3B-like routing, 128 experts top-8 over 8-16 layers, runs in
minutes). A tokenizer is trained on the spot; the real local engine samples `--prompts` x
`--samples` rollouts of `--new` tokens, recording routing, with its precision set by
`--engine`:

- `router-bf16` (default): the engine's routers' weights rounded to bf16, everything else
  fp32: the precision gap of a bf16 inference server, confined to the routing;
- `model-bf16`: the whole engine model in bf16 against an fp32 trainer;
- `both-bf16`: engine and trainers in bf16, the same weights (the trainer's kernels and
  layout still differ from the engine's: full sequences against a KV cache, left padding);
- `fp32`: the same fp32 weights on both sides (replay must change nothing).

Each arm is a fresh trainer over the same weights: |trainer log-prob - engine log-prob| of
the sampled tokens (mean, 99th percentile and max, one no-grad pass), the share of (token,
layer) pairs whose experts the trainer's router would have chosen otherwise, then
`--repeats` timed `train_step`s after one warm-up (none with `--repeats 0`). Arms: `torch`
and `torch+replay`; with `--megatron`, `megatron` and `megatron+replay` (megatron-core's
router replay). The ratio is the arm's mean (max) mismatch without replay over with it.
With `--engine router-bf16` a last row, `floor`, is `torch+replay` on a trainer holding the
engine's bf16-rounded router weights: what replay leaves once the gate weights agree (fp32
noise, if the records line up and the gate weights are computed as the engine's), so the
`torch+replay` residual above it is the gate weights' own precision gap. The load average is
read before and after; the routing record's size per token is printed.

    python bench/moe_step.py [--prompts 8] [--samples 4] [--new 48] [--repeats 2]
        [--engine router-bf16|model-bf16|both-bf16|fp32] [--megatron]
        [--experts 8] [--top-k 2] [--layers 4] [--expert-width 192] [--tag NAME]

Prints a table and writes `bench/results/moe_step[_TAG].json`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import resource
import statistics
import time
from pathlib import Path

import torch

from asyncrl import config
from asyncrl.algo import batching
from asyncrl.config import AlgorithmSection, MegatronTrainerConfig, TorchTrainerConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.modeling import build_model, routers, train_tokenizer
from asyncrl.records import Batch, Group, Problem, Rollout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ENGINE = ("router-bf16", "model-bf16", "both-bf16", "fp32")


def engine_model(model, precision: str):
    """The engine's copy of `model` at `precision` (see the module docstring)."""
    eng = copy.deepcopy(model)
    if precision == "router-bf16":
        with torch.no_grad():
            for r in routers(eng):
                r.weight.copy_(r.weight.bfloat16().float())
    elif precision in ("model-bf16", "both-bf16"):
        eng = eng.to(torch.bfloat16)
    return eng


def sample(model, tok, args) -> list[Rollout]:
    eng_model = engine_model(model, args.engine)
    rng = random.Random(0)
    prompts = [tok.encode(f"What is {rng.randint(10, 999)} * {rng.randint(10, 999)}?")
               for _ in range(args.prompts)]

    async def one(e, i):
        ids = prompts[i // args.samples]
        sp = SamplingParams(max_new_tokens=args.new, temperature=1.0, seed=i)
        out, lps, rec = [], [], None
        async for d in e.stream(GenerateRequest(request_id=f"r{i}", input_ids=ids, sampling=sp)):
            out += d.token_ids
            lps += d.logprobs
            rec = d.routed_experts or rec
        return Rollout(rollout_id=f"r{i}", prompt_id="p", group_id=f"g{i // args.samples}",
                       policy_version=0, prompt_ids=ids, response_ids=out,
                       loss_mask=[1] * len(out), logprobs=lps, routed_experts=rec)

    async def run():
        async with LocalEngine(eng_model, tok, kv_token_budget=32768, max_running=64,
                               record_routing=True) as e:
            return await asyncio.gather(*(one(e, i) for i in range(args.prompts * args.samples)))

    return asyncio.run(run())


def batch_of(rollouts: list[Rollout], samples: int) -> Batch:
    groups = []
    for g in range(0, len(rollouts), samples):
        ros = rollouts[g:g + samples]
        groups.append(Group(group_id=f"g{g}", problem=Problem(id="p", question="", answer=""),
                            rollouts=ros, kept=list(range(len(ros))),
                            advantages=[1.0 if i % 2 else -1.0 for i in range(len(ros))]))
    return Batch(step=0, policy_version=0, groups=groups)


def trainer(kind: str, model, tok, replay: bool, bf16: bool):
    algo = AlgorithmSection(lr=1e-4, routing_replay=replay)
    if kind == "torch":
        from asyncrl.trainer.torch_trainer import TorchTrainer

        m = copy.deepcopy(model)
        return TorchTrainer(m.to(torch.bfloat16) if bf16 else m, TorchTrainerConfig(threads=1),
                            algo, pad_token_id=tok.pad_token_id)
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(copy.deepcopy(model), MegatronTrainerConfig(recompute="none"), algo,
                           pad_token_id=tok.pad_token_id,
                           dtype="bfloat16" if bf16 else "float32")


def arm(kind: str, replay: bool, model, tok, rollouts, args, name: str = "") -> dict:
    tr = trainer(kind, model, tok, replay, bf16=args.engine == "both-bf16")
    diffs = []
    with torch.no_grad():
        for mb in tr.plan(batching.sequences_from_batch(batch_of(rollouts, args.samples))):
            t = tr.tensors(mb)
            on = t["mask"] > 0
            lp = tr.logprobs(t, 1.0).float()
            diffs.append((lp[on] - t["sampling_logprobs"][on]).abs())
    d = torch.cat(diffs).double()
    changed = None
    if replay:
        from asyncrl.trainer.moe_replay import replay_metrics

        counts = tr.replay.take_counts() if kind == "megatron" else None
        m = replay_metrics(counts, "") if counts is not None else tr.replay.metrics("")
        changed = m.get("routing_replay_changed")
    times = []
    if args.repeats:
        tr.train_step(batch_of(copy.deepcopy(rollouts), args.samples))  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tr.train_step(batch_of(copy.deepcopy(rollouts), args.samples))
            times.append(time.perf_counter() - t0)
    return {"arm": name or kind + ("+replay" if replay else ""), "mismatch_mean": float(d.mean()),
            "mismatch_p99": float(d.quantile(0.99)), "mismatch_max": float(d.max()),
            "tokens": d.numel(), "changed": changed,
            "step_s": statistics.median(times) if times else None, "times": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engine", choices=ENGINE, default="router-bf16")
    p.add_argument("--megatron", action="store_true")
    p.add_argument("--experts", type=int, help="experts per layer (tiny-moe: 8)")
    p.add_argument("--top-k", type=int, help="experts per token (tiny-moe: 2)")
    p.add_argument("--layers", type=int, help="layers, all sparse (tiny-moe: 4)")
    p.add_argument("--expert-width", type=int, help="moe_intermediate_size (tiny-moe: 192)")
    p.add_argument("--tag", default="", help="results file suffix")
    args = p.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    init = dict(config.load(ROOT / "curricula" / "tiny-moe.toml").model.init)
    for key, value in (("num_experts", args.experts), ("num_experts_per_tok", args.top_k),
                       ("num_hidden_layers", args.layers),
                       ("moe_intermediate_size", args.expert_width)):
        if value is not None:
            init[key] = value
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} * {rng.randint(0, 999)}? ```python\\nprint(1)\\n```"
              for _ in range(400)]
    tok = train_tokenizer(corpus, vocab_size=512)
    model = build_model(init, tok, seed=0)
    t0 = time.perf_counter()
    rollouts = sample(model, tok, args)
    sample_s = time.perf_counter() - t0
    rec = rollouts[0].routed_experts
    per_token = rec.layers * rec.top_k * rec.itemsize
    rows = [arm("torch", r, model, tok, rollouts, args) for r in (False, True)]
    if args.megatron:
        from asyncrl.trainer.megatron.cpu_compat import cpu_megatron

        with cpu_megatron():
            rows += [arm("megatron", r, model, tok, rollouts, args) for r in (False, True)]
    for free, rep in zip(rows[::2], rows[1::2], strict=True):
        for r in (free, rep):
            r["ratio_mean"] = free["mismatch_mean"] / rep["mismatch_mean"]
            r["ratio_max"] = free["mismatch_max"] / rep["mismatch_max"]
    if args.engine == "router-bf16":  # the residual's floor: the engine's own router weights
        floor = arm("torch", True, engine_model(model, args.engine), tok, rollouts,
                    argparse.Namespace(**{**vars(args), "repeats": 0}), name="floor")
        floor["ratio_mean"] = rows[0]["mismatch_mean"] / floor["mismatch_mean"]
        floor["ratio_max"] = rows[0]["mismatch_max"] / floor["mismatch_max"]
        rows.append(floor)
    load1 = os.getloadavg()
    shape = (f"{init['num_experts']} experts, top-{init['num_experts_per_tok']}, "
             f"{init['num_hidden_layers']} layers, hidden {init['hidden_size']}, expert width "
             f"{init['moe_intermediate_size']}")
    print(f"{shape}; {len(rollouts)} rollouts of {args.new} tokens sampled in {sample_s:.0f} s; "
          f"engine {args.engine}; record {per_token} B/token; load {load0[0]:.1f} -> "
          f"{load1[0]:.1f}")
    print(f"{'arm':<17}{'mean':>10}{'p99':>10}{'max':>10}{'ratio mean':>12}{'ratio max':>11}"
          f"{'changed':>9}{'step s':>8}")
    for r in rows:
        ch = "-" if r["changed"] is None else f"{r['changed']:.4f}"
        st = "-" if r["step_s"] is None else f"{r['step_s']:.2f}"
        print(f"{r['arm']:<17}{r['mismatch_mean']:>10.2e}{r['mismatch_p99']:>10.2e}"
              f"{r['mismatch_max']:>10.2e}{r['ratio_mean']:>12.1f}{r['ratio_max']:>11.1f}"
              f"{ch:>9}{st:>8}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "shape": shape, "model_init": init, "load_before": load0,
           "load_after": load1, "sample_s": sample_s, "record_bytes_per_token": per_token,
           "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "arms": rows}
    name = f"moe_step_{args.tag}.json" if args.tag else "moe_step.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
