"""Deterministic tiny models and RL batches for the trainer tests and the torchrun worker.

Not a test module: imported by `test_torch_trainer.py`, `test_trainer_distributed.py` and run
inside `dist_worker.py` (which cannot use pytest fixtures), so both sides build the same model
and batch from a seed.
"""

from __future__ import annotations

import random

from asyncrl.algo.advantages import group_advantages
from asyncrl.records import Batch, Group, Problem, Rollout

VOCAB = 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=True, vocab_size=VOCAB)


def tiny_model(seed: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **TINY)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def rl_batch(seed: int = 0, groups: int = 3, per_group: int = 4, vocab: int = VOCAB,
             min_len: int = 4, max_len: int = 24, prompt: tuple[int, int] = (3, 8),
             system: int = 0) -> Batch:
    """Random prompts (lengths in `prompt`, after `system` tokens common to every prompt) and
    responses with a tool-output span (mask 0) in some responses, alternating rewards and the
    GRPO advantages of each group."""
    rng = random.Random(seed)
    common = [rng.randrange(2, vocab) for _ in range(system)]
    out = []
    for g in range(groups):
        prompt_ids = common + [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt))]
        rollouts = []
        for i in range(per_group):
            n = rng.randint(min_len, max_len)
            mask = [1] * n
            if n > 8 and rng.random() < 0.5:
                start = rng.randint(2, n - 4)
                mask[start:start + 3] = [0, 0, 0]
            rollouts.append(Rollout(
                rollout_id=f"{g}-{i}", prompt_id=str(g), group_id=str(g), policy_version=0,
                prompt_ids=prompt_ids, response_ids=[rng.randrange(2, vocab) for _ in range(n)],
                loss_mask=mask, logprobs=[-4.5 if m else 0.0 for m in mask],
                reward=float((i + g) % 2)))
        rewards = [r.reward for r in rollouts]
        out.append(Group(group_id=str(g), problem=Problem(id=str(g), question="q", answer="1"),
                         rollouts=rollouts, kept=list(range(per_group)),
                         advantages=group_advantages(rewards)))
    return Batch(step=1, policy_version=0, groups=out)
