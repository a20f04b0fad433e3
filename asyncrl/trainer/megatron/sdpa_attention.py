"""A core attention for megatron-core's local layer spec that calls torch's fused
`scaled_dot_product_attention` (flash / memory-efficient / cuDNN kernels on CUDA, the flash
kernel on CPU).

Owns: `SDPACoreAttention`, a drop-in for megatron-core 0.16's `DotProductAttention` in the
`core_attention` slot of `SelfAttentionSubmodules` (same constructor keywords, same forward
signature, same [sq, b, np, hn] -> [sq, b, np * hn] layout), and `local_spec`, the GPT layer
spec that uses it. Does not own the choice between it and Transformer Engine (`model.py`).

Why: `DotProductAttention` materialises a [b * np, sq, sk] score matrix (the full square,
twice the causal FLOPs), `masked_fill_`s it, runs the softmax in float32 and repeats K/V for
GQA. The fused kernels never materialise the scores and save only q, k, v, the output and a
log-sum-exp for backward, so selective recompute of the attention stops being necessary.

Numerics equal `DotProductAttention`'s (tests: fp32 outputs and gradients to float tolerance):
- Scale: `softmax_scale`, or 1/sqrt(hn) when None. `apply_query_key_layer_scaling` divides
  the QK^T scale by the layer number and multiplies the scores back inside the softmax: net
  effect nil, so it is not applied here.
- Masks (`attn_mask_type`, per call or else the constructor's): `causal` builds the causal
  mask inside the kernel and ignores `attention_mask`, as TE's attention does (megatron's
  local one would use a given mask instead; the trainer passes none). `no_mask` attends
  everywhere. `padding` / `arbitrary` take megatron's bool mask (True = masked) and hand SDPA
  its inverse; `padding_causal` adds the causal triangle to it. A query row whose keys are all
  masked yields NaN here, where megatron's -10000 fill gives a uniform average; no trainer
  batch has one (right padding under a causal mask keeps every row's own token).
- GQA: `enable_gqa=True`, so K/V are never repeated, except on CUDA in float32, where only
  the math kernel takes `enable_gqa` and an explicit repeat keeps the memory-efficient kernel
  (whose O(s) memory is worth more than the repeat's O(s * heads) copy).
- Dropout: `config.attention_dropout` (0 in every recipe), under megatron's CUDA RNG tracker
  fork like `DotProductAttention`.

Not supported (clear errors, not silent fallbacks): packed THD batches (`packed_seq_params`),
attention bias, context parallel, sliding windows, non-vanilla softmax.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

# `enable_gqa` arrived in torch 2.5 (a builtin: no inspectable signature).
_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class SDPACoreAttention(MegatronModule):
    """megatron-core's `CoreAttention` protocol on `torch.nn.functional.scaled_dot_product_attention`.

    Has no parameters. Head counts come from the tensors, not the config (`Attention` hands a
    copy of the config with `num_query_groups` raised to the TP size when there are fewer KV
    groups than TP ranks).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention: context parallel needs TE attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(
                f"SDPACoreAttention: softmax_type={config.softmax_type!r} is not supported")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise NotImplementedError("SDPACoreAttention: sliding-window attention is not "
                                      "supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        """`query` [sq, b, np, hn], `key`/`value` [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed (THD) sequences are not "
                                      "supported; pass right-padded rows")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        sq, b, nq, hn = query.shape
        sk, nkv = key.shape[0], key.shape[2]
        if nq % nkv:
            raise ValueError(f"SDPACoreAttention: {nq} query heads over {nkv} KV heads")
        causal, mask = self._mask(attn_mask_type or self.attn_mask_type, attention_mask, sq, sk,
                                  query.device)
        # [s, b, h, d] -> [b, h, s, d] views (last dim contiguous, which every kernel accepts).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = nq != nkv
        if gqa and (not _HAS_ENABLE_GQA or (q.is_cuda and q.dtype == torch.float32)):
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.repeat_interleave(nq // nkv, dim=1)
            gqa = False
        p = self.dropout_p if self.training else 0.0
        kw: dict[str, Any] = {"enable_gqa": True} if gqa else {}
        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                     is_causal=causal, scale=self.softmax_scale,
                                                     **kw)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=causal, scale=self.softmax_scale, **kw)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * hn)

    @staticmethod
    def _mask(kind: AttnMaskType, attention_mask: torch.Tensor | None, sq: int, sk: int,
              device: torch.device) -> tuple[bool, torch.Tensor | None]:
        """(is_causal, SDPA bool mask with True = attend) for megatron's mask type and mask."""
        if kind in (AttnMaskType.causal, AttnMaskType.causal_bottom_right):
            if sq == 1:  # one query (a decode step) sees every key
                return False, None
            if sq != sk:
                raise NotImplementedError(f"SDPACoreAttention: causal attention with sq={sq} "
                                          f"!= sk={sk}")
            return True, None
        if kind == AttnMaskType.no_mask:
            return False, None
        if attention_mask is None:
            raise ValueError(f"SDPACoreAttention: attn_mask_type={kind.name} needs an "
                             "attention_mask")
        masked = attention_mask.to(torch.bool)
        if kind == AttnMaskType.padding_causal:
            tri = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)
            masked = masked | tri
        return False, ~masked


def local_spec(qk_layernorm: bool, num_experts: int | None = None) -> Any:
    """megatron-core's local GPT layer spec (RMSNorm, no TE) with `SDPACoreAttention` in the
    core-attention slot; everything else is `get_gpt_layer_local_spec`'s."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
