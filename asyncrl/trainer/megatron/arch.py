"""What a HF decoder config means to megatron-core: one `Arch` per supported model family.

Owns: reading a transformers config (Qwen3, Qwen3-MoE, Qwen2, Llama) into the handful of facts the
Megatron model and the weight conversion need, rejecting what they do not support with a
message that names the field, and the `TransformerConfig` keyword arguments those facts imply.
Does not own: building the model (`model.py`) or moving weights (`convert.py`).

Imports neither torch nor megatron, so it is testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.trainer.megatron.errors import UnsupportedModelError

# model_type -> (q/k per-head RMSNorm, q/k/v projections carry a bias)
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "qwen3": (True, False),
    "qwen3_moe": (True, False),
    "qwen2": (False, True),
    "llama": (False, False),
}


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A dense decoder-only transformer with RMSNorm, RoPE, GQA and a SwiGLU MLP."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_llama3_factor: float | None
    """Llama-3.1 RoPE scaling factor (megatron-core's `rope_scaling`), None when unscaled."""
    tied_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    num_experts: int = 0
    """Mixture of experts (Qwen3-MoE): experts per layer, every layer sparse; 0 = dense."""
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = True
    """The top-k weights renormalised to sum to 1 (HF `norm_topk_prob`; megatron's softmax
    after top-k, `moe_router_pre_softmax = False`), else the softmax over all experts."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: Any) -> Arch:
        """From a `transformers.PretrainedConfig` (or anything with the same attributes)."""
        model_type = getattr(cfg, "model_type", "")
        if model_type not in _FAMILIES:
            raise UnsupportedModelError(
                "model_type", f"{model_type!r} is not supported; expected one of {sorted(_FAMILIES)}"
            )
        qk_norm, qkv_bias = _FAMILIES[model_type]
        if model_type == "llama":
            qkv_bias = bool(getattr(cfg, "attention_bias", False))
            if getattr(cfg, "mlp_bias", False):
                raise UnsupportedModelError("mlp_bias", "MLP biases are not supported")
        elif model_type == "qwen3" and getattr(cfg, "attention_bias", False):
            qkv_bias = True
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError("hidden_act", f"{cfg.hidden_act!r}; only silu (SwiGLU)")
        if getattr(cfg, "use_sliding_window", False):
            raise UnsupportedModelError("use_sliding_window", "sliding-window attention")
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if heads % kv:
            raise UnsupportedModelError("num_key_value_heads", f"{kv} does not divide {heads} heads")
        theta, llama3 = _rope(cfg)
        moe = _moe(cfg) if model_type == "qwen3_moe" else {}
        return cls(**moe,
            model_type=model_type,
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            ffn_hidden_size=int(cfg.intermediate_size),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            max_position_embeddings=int(cfg.max_position_embeddings),
            norm_eps=float(cfg.rms_norm_eps),
            rope_theta=theta,
            rope_llama3_factor=llama3,
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
        )

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise if this model cannot be split `tp` ways by tensor and `pp` ways by layers."""
        for field, n in (("num_key_value_heads", self.num_kv_heads),
                         ("num_attention_heads", self.num_heads),
                         ("intermediate_size", self.ffn_hidden_size),
                         ("vocab_size", self.vocab_size)):
            if n % tp:
                raise UnsupportedModelError(field, f"{n} is not divisible by tensor_parallel={tp}")
        if self.num_experts and tp > 1:
            raise UnsupportedModelError("num_experts", "tensor parallelism of a mixture-of-"
                                        "experts model is not wired yet (use tensor_parallel=1)")
        if self.num_layers % pp:
            raise UnsupportedModelError(
                "num_hidden_layers", f"{self.num_layers} is not divisible by pipeline_parallel={pp}"
            )

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of megatron-core's `TransformerConfig` that define the network.

        Parallelism, dtype and performance switches are added by the caller.
        """
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_heads,
            "num_query_groups": self.num_kv_heads,
            "kv_channels": self.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.norm_eps,
            "qk_layernorm": self.qk_norm,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            # SwiGLU: the gated MLP applies `activation_func` (silu, set by the model builder,
            # since it is a callable) to the first half of fc1 and multiplies by the second.
            "gated_linear_unit": True,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            **self._moe_kwargs(),
        }

    def _moe_kwargs(self) -> dict[str, Any]:
        if not self.num_experts:
            return {}
        return {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.moe_top_k,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_router_pre_softmax": not self.moe_norm_topk,
            # RL's loss is the policy's alone (HF's aux loss applies only with
            # output_router_logits, off in every asyncrl forward)
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_grouped_gemm": False,
        }

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `GPTModel` beyond config and layer spec."""
        kw: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "share_embeddings_and_output_weights": self.tied_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": self.rope_theta,
        }
        if self.rope_llama3_factor is not None:
            kw.update(rope_scaling=True, rope_scaling_factor=self.rope_llama3_factor)
        return kw

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, f, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * h * f
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h)
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + emb + h


def _moe(cfg: Any) -> dict[str, Any]:
    """Qwen3-MoE's expert fields; refuses the layouts megatron's uniform layer spec cannot
    express here (dense layers between sparse ones)."""
    if int(getattr(cfg, "decoder_sparse_step", 1) or 1) != 1:
        raise UnsupportedModelError("decoder_sparse_step", "only every layer sparse (1)")
    if getattr(cfg, "mlp_only_layers", None):
        raise UnsupportedModelError("mlp_only_layers", "dense layers among sparse ones")
    return {"num_experts": int(cfg.num_experts), "moe_top_k": int(cfg.num_experts_per_tok),
            "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
            "moe_norm_topk": bool(getattr(cfg, "norm_topk_prob", True))}


def _rope(cfg: Any) -> tuple[float, float | None]:
    """(theta, llama3 factor) from `rope_parameters` (transformers 5) or the older fields."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        # megatron-core hard-codes the Llama-3.1 constants; accept only configs that match them.
        expect = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
        for key, value in expect.items():
            if float(params.get(key, value)) != float(value):
                raise UnsupportedModelError(f"rope_parameters.{key}",
                                            f"{params[key]} (megatron-core assumes {value})")
        return theta, float(params.get("factor", 8.0))
    raise UnsupportedModelError("rope_parameters.rope_type", f"{kind!r} is not supported")
