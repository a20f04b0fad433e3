"""Tiny HF models of each supported family and RL batches for the Megatron trainer tests.

Not a test module: imported by the tests here and by `tp_worker.py` (run under torchrun,
without pytest fixtures), so both sides build the same models and batches from a seed.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.records import Batch, Group, Problem, Rollout

VOCAB = 256

# Qwen3 as in tests/conftest.py's TINY_QWEN3 (explicit head_dim, QK-norm, GQA, tied), with
# variants that exercise the other code paths of the conversion.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # head_dim != hidden / heads, untied output layer, MHA-free 4:1 GQA.
    "qwen3_untied": dict(model_type="qwen3", hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def hf_config(family: str = "qwen3") -> Any:
    from transformers import AutoConfig

    opts = dict(FAMILIES[family])
    return AutoConfig.for_model(opts.pop("model_type"), vocab_size=VOCAB, **opts)


def hf_model(family: str = "qwen3", seed: int = 0) -> Any:
    """A random HF model whose norms (and biases) are not at their init values, so a
    conversion that dropped or swapped one would show in the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def rl_batch(seed: int = 0, groups: int = 3, per_group: int = 4) -> Batch:
    """Prompts and responses of varied length, tool-output spans (mask 0), and advantages
    of both signs, some large enough for the dual clip to matter once the ratio moves."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 9))]
        rollouts = []
        for i in range(per_group):
            n = rng.randint(4, 28)
            mask = [1] * n
            if n > 8:
                start = rng.randint(2, n - 4)
                mask[start:start + 3] = [0, 0, 0]
            rollouts.append(Rollout(
                rollout_id=f"{g}-{i}", prompt_id=str(g), group_id=str(g), policy_version=0,
                prompt_ids=prompt, response_ids=[rng.randrange(2, VOCAB) for _ in range(n)],
                loss_mask=mask, logprobs=[-rng.uniform(0.5, 6.0) if m else 0.0 for m in mask]))
        advantages = [rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0) for _ in rollouts]
        out.append(Group(group_id=str(g), problem=Problem(id=str(g), question="q", answer="1"),
                         rollouts=rollouts, kept=list(range(per_group)), advantages=advantages))
    return Batch(step=1, policy_version=0, groups=out)


def sft_examples(seed: int = 0, n: int = 5) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(6, 30)
        ids = [rng.randrange(2, VOCAB) for _ in range(k)]
        mask = [0] * 3 + [1] * (k - 3)
        out.append((ids, mask))
    return out
