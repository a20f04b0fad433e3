"""Rollouts a local engine sampled from a tiny Qwen3-MoE, with the experts it routed to: the
cases of the routing-replay tests of both trainers (`tests/trainer/test_moe_replay.py`,
`tests/megatron/test_moe.py`). Not a test module."""

from __future__ import annotations

import asyncio
import copy
import random

import torch

from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.modeling import routers
from asyncrl.records import Batch, Group, Problem, Rollout

PROMPTS = 8
SAMPLES = 2
NEW = 40


def sample_rollouts(model, tok, bf16_router: bool, other_choice: float = 0.0
                    ) -> list[Rollout]:
    """`other_choice` > 0: the engine's routers choose their experts by their weights plus
    noise of that scale (deliberate flips), and weight them by the model's own probabilities
    at those experts, as a replaying trainer does: with replay, a trainer over the same fp32
    weights must then reproduce the engine's log-probs."""
    engine_model = copy.deepcopy(model)
    if bf16_router:
        with torch.no_grad():
            for r in routers(engine_model):
                r.weight.copy_(r.weight.bfloat16().float())
    if other_choice:
        gen = torch.Generator().manual_seed(1)
        for r in routers(engine_model):
            r.forward = _other_choice(r, other_choice * torch.randn(r.weight.shape,
                                                                    generator=gen))
    prompts = [tok.encode(f"What is {a} + {3 * a}?") for a in range(PROMPTS)]

    async def one(e, i):
        ids = prompts[i // SAMPLES]
        sp = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=i)
        out, lps, rec = [], [], None
        async for d in e.stream(GenerateRequest(request_id=f"r{i}", input_ids=ids, sampling=sp)):
            out += d.token_ids
            lps += d.logprobs
            rec = d.routed_experts or rec
        return Rollout(rollout_id=f"r{i}", prompt_id=f"p{i // SAMPLES}", group_id="g",
                       policy_version=0, prompt_ids=ids, response_ids=out,
                       loss_mask=[1] * len(out), logprobs=lps, routed_experts=rec)

    async def main():
        async with LocalEngine(engine_model, tok, kv_token_budget=8192, max_running=16,
                               record_routing=True) as e:
            return await asyncio.gather(*(one(e, i) for i in range(PROMPTS * SAMPLES)))

    return asyncio.run(main())


def _other_choice(router, noise: torch.Tensor):
    def forward(hidden):
        hidden = hidden.reshape(-1, router.weight.shape[1])
        logits = torch.nn.functional.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        pick = torch.nn.functional.linear(hidden, router.weight + noise)
        idx = torch.topk(pick, router.top_k, dim=-1).indices
        weights = probs.gather(1, idx)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), idx

    return forward


def one_batch(rollouts: list[Rollout]) -> Batch:
    g = Group(group_id="g", problem=Problem(id="p", question="", answer=""), rollouts=rollouts,
              kept=list(range(len(rollouts))), advantages=[1.0] * len(rollouts))
    return Batch(step=0, policy_version=0, groups=[g])


def shuffled(rollouts: list[Rollout]) -> list[Rollout]:
    """The same records with their token rows permuted within each rollout."""
    rng = random.Random(0)
    out = copy.deepcopy(rollouts)
    for ro in out:
        rec = ro.routed_experts
        row = rec.layers * rec.top_k * rec.itemsize
        rows = [rec.data[i:i + row] for i in range(0, len(rec.data), row)]
        rng.shuffle(rows)
        rec.data = b"".join(rows)
    return out
