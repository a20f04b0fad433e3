"""Seconds per RL update of the torch trainer in its three layouts: the LM head at every
position (`full`: `trainer.full_logits`), at the trained positions only (`split`;
`asyncrl/trainer/lm_head.py`), and that with each group's prompt computed once (`shared`:
`trainer.share_prefixes`, the default; `asyncrl/trainer/shared_prefix.py`).

A random model of SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads,
MLP 1536, vocabulary 49,152, tied embeddings; fp32), built from a config (nothing downloaded),
and one batch of GRPO groups: `--groups` prompts x `--per-group` samples, `--prompt` prompt
tokens and `--completion` response tokens each, every response token trained, rewards
alternating so that every advantage is nonzero. Each arm gets a fresh trainer over the same
weights, takes one small warm-up step, then `--repeats` timed `train_step`s on the batch (one
mini-batch: the training forward gives the old log-probs, one forward and one backward per
micro-batch, and one AdamW step). The load average is read before and after. `--profile N`
prints the N ops of the last arm's last update that took the most time.

    python bench/rl_update.py [--groups 4] [--per-group 8] [--prompt 200]
        [--completion 128] [--micro-batch-tokens 2048] [--repeats 1]
        [--arms full split shared] [--profile 0]

Prints a table and writes `bench/results/rl_update.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_theta=100000.0)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def batch(groups: int, per_group: int, prompt: int, completion: int, vocab: int, seed: int):
    from asyncrl.algo.advantages import group_advantages
    from asyncrl.records import Batch, Group, Problem, Rollout

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        ids = [rng.randrange(2, vocab) for _ in range(prompt)]
        rollouts = [Rollout(
            rollout_id=f"{g}-{i}", prompt_id=str(g), group_id=str(g), policy_version=0,
            prompt_ids=ids, response_ids=[rng.randrange(2, vocab) for _ in range(completion)],
            loss_mask=[1] * completion, logprobs=[-10.8] * completion, reward=float(i % 2))
            for i in range(per_group)]
        out.append(Group(group_id=str(g), problem=Problem(id=str(g), question="q", answer="1"),
                         rollouts=rollouts, kept=list(range(per_group)),
                         advantages=group_advantages([r.reward for r in rollouts])))
    return Batch(step=1, policy_version=0, groups=out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--arms", nargs="+", default=["full", "split", "shared"],
                   choices=["full", "split", "shared"])
    p.add_argument("--profile", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "rl_update.json"))
    args = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config import AlgorithmSection, TorchTrainerConfig
    from asyncrl.trainer.torch_trainer import TorchTrainer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMOLLM2_135M))
    vocab = SMOLLM2_135M["vocab_size"]
    work = batch(args.groups, args.per_group, args.prompt, args.completion, vocab, 0)
    warm = batch(1, 2, 8, 8, vocab, 1)
    rows = []
    for arm in args.arms:
        tr = TorchTrainer(copy.deepcopy(base), TorchTrainerConfig(
            micro_batch_tokens=args.micro_batch_tokens, full_logits=arm == "full",
            share_prefixes=arm == "shared"),
            AlgorithmSection(lr=1e-6), pad_token_id=0)
        tr.train_step(warm)
        load0 = loadavg()
        times, metrics = [], {}
        for i in range(args.repeats):
            prof = None
            if args.profile and arm == args.arms[-1] and i == args.repeats - 1:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            t0 = time.perf_counter()
            metrics = tr.train_step(work)
            times.append(time.perf_counter() - t0)
            if prof is not None:
                prof.__exit__(None, None, None)
                print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                row_limit=args.profile))
        rows.append({"arm": arm, "seconds": times, "load_before": load0, "load_after": loadavg(),
                     "micro_batches": metrics["train/micro_batches"],
                     "tokens": metrics["train/tokens"], "loss": metrics["train/loss"],
                     "threads": torch.get_num_threads()})
        del tr
    first = min(rows[0]["seconds"])
    print(f"{args.groups * args.per_group} rows x ({args.prompt} prompt + {args.completion} "
          f"response) tokens, micro_batch_tokens {args.micro_batch_tokens}, "
          f"{rows[0]['threads']} threads")
    print("| arm | seconds per RL update | vs first arm | micro-batches | load before -> after |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        s = min(r["seconds"])
        print(f"| {r['arm']} | {' '.join(f'{x:.1f}' for x in r['seconds'])} | "
              f"{first / s:.2f}x | {r['micro_batches']:.0f} | "
              f"{r['load_before']} -> {r['load_after']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
