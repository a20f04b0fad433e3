"""The RL step on a mixture-of-experts model, with and without routing replay, on the CPU.

The model of `curricula/tiny-moe.toml` (Qwen3-MoE, 4 layers, 8 experts, top-2; random
weights) and a tokenizer trained on the spot; the local engine samples `--prompts` x
`--samples` rollouts of `--new` tokens, recording routing, its routers' weights rounded to
bf16 (`--engine-router bf16`, the default: the precision gap of a bf16 inference server
against an fp32 trainer, confined to the routing) or left fp32. Each arm is a fresh trainer
over the same weights: the mismatch |trainer log-prob - engine log-prob| of the sampled
tokens (mean and max, one no-grad pass), the share of (token, layer) pairs whose experts the
trainer's router would have changed, then `--repeats` timed `train_step`s (after one
warm-up). Arms: `torch` and `torch+replay`; with `--megatron`, `megatron` and
`megatron+replay` (megatron-core's router replay). The load average is read before and
after; the routing record's size per token is printed.

    python bench/moe_step.py [--prompts 8] [--samples 4] [--new 48] [--repeats 2]
        [--engine-router bf16|fp32] [--megatron]

Prints a table and writes `bench/results/moe_step.json`.
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


def sample(model, tok, args) -> list[Rollout]:
    eng_model = copy.deepcopy(model)
    if args.engine_router == "bf16":
        with torch.no_grad():
            for r in routers(eng_model):
                r.weight.copy_(r.weight.bfloat16().float())
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


def trainer(kind: str, model, tok, replay: bool):
    algo = AlgorithmSection(lr=1e-4, routing_replay=replay)
    if kind == "torch":
        from asyncrl.trainer.torch_trainer import TorchTrainer

        return TorchTrainer(copy.deepcopy(model), TorchTrainerConfig(threads=1), algo,
                            pad_token_id=tok.pad_token_id)
    from asyncrl.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(copy.deepcopy(model), MegatronTrainerConfig(recompute="none"), algo,
                           pad_token_id=tok.pad_token_id)


def arm(kind: str, replay: bool, model, tok, rollouts, args) -> dict:
    tr = trainer(kind, model, tok, replay)
    diffs = []
    with torch.no_grad():
        for mb in tr.plan(batching.sequences_from_batch(batch_of(rollouts, args.samples))):
            t = tr.tensors(mb)
            on = t["mask"] > 0
            diffs.append((tr.logprobs(t, 1.0)[on] - t["sampling_logprobs"][on]).abs())
    d = torch.cat(diffs)
    changed = None
    if replay:
        from asyncrl.trainer.moe_replay import replay_metrics

        counts = tr.replay.take_counts() if kind == "megatron" else None
        m = replay_metrics(counts, "") if counts is not None else tr.replay.metrics("")
        changed = m.get("routing_replay_changed")
    tr.train_step(batch_of(copy.deepcopy(rollouts), args.samples))  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tr.train_step(batch_of(copy.deepcopy(rollouts), args.samples))
        times.append(time.perf_counter() - t0)
    return {"arm": kind + ("+replay" if replay else ""), "mismatch_mean": float(d.mean()),
            "mismatch_max": float(d.max()), "tokens": d.numel(), "changed": changed,
            "step_s": statistics.median(times), "times": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engine-router", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--megatron", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    init = dict(config.load(ROOT / "curricula" / "tiny-moe.toml").model.init)
    rng = random.Random(0)
    corpus = [f"What is {rng.randint(0, 999)} * {rng.randint(0, 999)}? ```python\\nprint(1)\\n```"
              for _ in range(400)]
    tok = train_tokenizer(corpus, vocab_size=512)
    model = build_model(init, tok, seed=0)
    rollouts = sample(model, tok, args)
    rec = rollouts[0].routed_experts
    per_token = rec.layers * rec.top_k * rec.itemsize
    rows = [arm("torch", r, model, tok, rollouts, args) for r in (False, True)]
    if args.megatron:
        from asyncrl.trainer.megatron.cpu_compat import cpu_megatron

        with cpu_megatron():
            rows += [arm("megatron", r, model, tok, rollouts, args) for r in (False, True)]
    load1 = os.getloadavg()
    print(f"tiny-moe ({init['num_experts']} experts, top-{init['num_experts_per_tok']}, "
          f"{init['num_hidden_layers']} layers), {len(rollouts)} rollouts, engine routers "
          f"{args.engine_router}; record {per_token} B/token; load {load0[0]:.1f} -> "
          f"{load1[0]:.1f}")
    print(f"{'arm':<18}{'|dlogp| mean':>14}{'|dlogp| max':>13}{'changed':>9}{'step s':>9}")
    for r in rows:
        ch = "-" if r["changed"] is None else f"{r['changed']:.4f}"
        print(f"{r['arm']:<18}{r['mismatch_mean']:>14.2e}{r['mismatch_max']:>13.2e}{ch:>9}"
              f"{r['step_s']:>9.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "load_before": load0, "load_after": load1,
           "record_bytes_per_token": per_token,
           "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "arms": rows}
    (RESULTS / "moe_step.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
