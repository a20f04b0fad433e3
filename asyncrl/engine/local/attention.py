"""The local engine's attention: one-token steps of grouped-query attention without copying
the key/value heads.

Why: a decode step of a batch always passes a mask (left padding in the eager path, each row's
own length in the static one), and transformers' `sdpa` attention before 5.2x answers a mask
with `repeat_kv`: every layer's whole cache copied once per query head group, each step
(Qwen3-0.6B, 256 rows, width 512: about 2 GB written and read a layer; the H200 sweep of
2026-11-29 ran transformers 5.17). Newer transformers pack one-token queries instead
(`pack_gqa`); this does the same on every version the project supports.

What: `install(model)` registers `NAME` with transformers' attention and mask interfaces and
points the model at it, when the model uses `sdpa` and has grouped heads. A step with one
query token reshapes the query `[B, heads, 1, D]` to `[B, kv heads, group, D]`, so the group's
heads become query positions over their shared key/value head; a mask shared by the heads
broadcasts as it is. Everything else (prefill, a softcap, dropout) is transformers' own
`sdpa_attention_forward`, unchanged. Same arithmetic per head: the outputs equal the repeated
form's up to rounding (tested against it in fp32).

Owns: that function and its installation on the engine's model (which the engine owns: the
caller passes a copy when a trainer keeps training the original). Does not own: the masks
(the engine's caches build them) or the other attention kinds (`eager`, flash), left alone.
"""

from __future__ import annotations

from typing import Any

NAME = "asyncrl_sdpa"
"""The name the engine's model uses for its attention once `install` ran."""


def decode_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature (`query` `[B, heads, Q, D]`, `key` and
    `value` `[B, kv heads, K, D]`); returns `([B, Q, heads, D], None)`."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    if (q_len != 1 or groups == 1 or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    kv_heads = heads // groups
    q = query.reshape(b, kv_heads, groups, dim)
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a mask per head: per (kv head, group)
        mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def install(model: Any) -> bool:
    """Point `model` (the engine's own) at `decode_attention` when it uses `sdpa` and groups
    its heads; True when it did. Leaves it alone on a transformers without the interfaces."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(text, "num_attention_heads", None)
    if not heads or heads == getattr(text, "num_key_value_heads", heads):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    AttentionInterface.register(NAME, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = NAME
    text._attn_implementation = NAME  # a multimodal model's text config (else `config` again)
    return True
