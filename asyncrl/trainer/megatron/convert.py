"""HF <-> megatron-core weight conversion, one parameter at a time, for any TP split.

Owns: the name map between a HF causal LM (`model.layers.N.self_attn.q_proj.weight`, ...) and
a megatron-core `GPTModel` (`decoder.layers.N.self_attention.linear_qkv.weight`, ...), and the
tensor surgery in between:

- `linear_qkv` is Megatron's fused projection laid out by query group: for each of the
  `num_kv_heads` groups, that group's `heads_per_group` query heads, then its key head, then its
  value head. A TP rank holds a contiguous run of `num_kv_heads / tp` groups. The same holds for
  its bias (Qwen2).
- `linear_fc1` is `[gate; up]` *per TP rank*: rank r holds the r-th slice of gate followed by the
  r-th slice of up, so the TP=1 tensor is not simply the concatenation of the rank tensors.
- Column-parallel weights (embedding, output layer) split on dim 0, row-parallel ones
  (`linear_proj`, `linear_fc2`) on dim 1; norms (incl. Qwen3's per-head q/k RMSNorm) replicate.
- Both the local layer spec's names (`input_layernorm`, `pre_mlp_layernorm`) and Transformer
  Engine's fused ones (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) map.
- Tied embeddings: the HF checkpoint has no `lm_head.weight`; a Megatron pipeline stage that
  holds a copy of the shared weight as `output_layer.weight` maps it to `embed_tokens`.
- Pipeline stages number their layers locally; `layer_offset` is the first global layer.
- Mixture of experts (Qwen3-MoE, HF checkpoint layout: `mlp.gate.weight` and one
  `mlp.experts.E.{gate,up,down}_proj.weight` per expert): the router `mlp.router.weight`
  replicates; expert j of a rank's `mlp.experts.local_experts.j` (megatron's SequentialMLP,
  the local spec) is global expert `expert_offset + j` (expert parallel ranks hold
  consecutive runs), its `linear_fc1` is `[gate; up]` and its `linear_fc2` is `down`.

Does not own: gathering shards or experts across ranks, or loading into a module (`model.py`).
Only torch tensor ops: no megatron import, so it is exercised without megatron-core.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from asyncrl.trainer.megatron.arch import Arch
from asyncrl.trainer.megatron.errors import ConversionError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_EXPERT_HF = {"linear_fc1": ("fc1", ("gate_proj.weight", "up_proj.weight")),
              "linear_fc2": ("row", ("down_proj.weight",))}

# Layer-local Megatron suffix -> (split kind, HF suffixes under `model.layers.N.`).
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_MOE_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
}


def _rule(name: str, arch: Arch, layer_offset: int, expert_offset: int = 0
          ) -> tuple[str, tuple[str, ...]]:
    """(split kind, HF names) of one Megatron parameter name."""
    if name == "embedding.word_embeddings.weight":
        return "col", ("model.embed_tokens.weight",)
    if name == "decoder.final_layernorm.weight":
        return "replicated", ("model.norm.weight",)
    if name == "output_layer.weight":
        return "col", ("model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight",)
    m = _LAYER.match(name)
    moe = arch.num_experts > 0
    e = _EXPERT.match(m.group(2)) if m and moe else None
    rules = {**_LAYER_RULES, **_MOE_RULES} if moe else _LAYER_RULES
    if m and (m.group(2) in rules or e):
        if e:
            expert = int(e.group(1)) + expert_offset
            if expert >= arch.num_experts:
                raise ConversionError(f"{name}: expert {expert} >= num_experts="
                                      f"{arch.num_experts}")
            kind, ends = _EXPERT_HF[e.group(2)]
            suffixes = tuple(f"mlp.experts.{expert}.{x}" for x in ends)
        else:
            kind, suffixes = rules[m.group(2)]
        layer = int(m.group(1)) + layer_offset
        if layer >= arch.num_layers:
            raise ConversionError(f"{name}: layer {layer} >= num_layers={arch.num_layers}")
        return kind, tuple(f"model.layers.{layer}.{s}" for s in suffixes)
    raise ConversionError(f"{name}: no HF counterpart is known for this Megatron parameter")


def is_weight(name: str) -> bool:
    """False for Megatron state-dict entries that hold no weights (`_extra_state`, buffers)."""
    return not name.endswith("_extra_state")


def is_expert(name: str) -> bool:
    """Whether a Megatron parameter is one expert's matrix (`...mlp.experts.local_experts.j.`
    `linear_fc{1,2}.weight`): the weights expert parallelism splits over ranks."""
    m = _LAYER.match(name)
    return bool(m and _EXPERT.match(m.group(2)))


def split_kind(name: str, arch: Arch, layer_offset: int = 0) -> str:
    """How a Megatron parameter is split over TP: replicated, col, row, qkv or fc1."""
    return _rule(name, arch, layer_offset)[0]


def hf_names(name: str, arch: Arch, layer_offset: int = 0) -> tuple[str, ...]:
    """The HF tensors a Megatron parameter is made of."""
    return _rule(name, arch, layer_offset)[1]


# ------------------------------------------------------------------------------ HF -> Megatron
def to_megatron(
    name: str,
    get_hf: Callable[[str], torch.Tensor],
    arch: Arch,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
    expert_offset: int = 0,
) -> torch.Tensor:
    """The `tp_rank` shard of Megatron parameter `name`, built from HF tensors read by `get_hf`."""
    kind, names = _rule(name, arch, layer_offset, expert_offset)
    hf = [get_hf(n) for n in names]
    if kind == "replicated":
        return hf[0]
    if kind == "col":
        return _chunk(hf[0], tp_size, 0, name)[tp_rank]
    if kind == "row":
        return _chunk(hf[0], tp_size, 1, name)[tp_rank]
    if kind == "fc1":
        gate, up = (_chunk(t, tp_size, 0, name)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    # qkv: interleave by query group, then take this rank's run of groups.
    q, k, v = hf
    ng, hd = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    _expect(q, (arch.num_heads * hd, *rest), names[0])
    _expect(k, (ng * hd, *rest), names[1])
    _expect(v, (ng * hd, *rest), names[2])
    fused = torch.cat([q.reshape(ng, arch.heads_per_group * hd, *rest),
                       k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1)
    return _chunk(fused, tp_size, 0, name)[tp_rank].reshape(-1, *rest)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    megatron_names: Iterable[str],
    arch: Arch,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """A Megatron state dict (weights only) for one rank, from a whole HF state dict."""

    def get(n: str) -> torch.Tensor:
        if n in hf:
            return hf[n]
        if n == "lm_head.weight" and arch.tied_embeddings:
            return hf["model.embed_tokens.weight"]
        raise ConversionError(f"HF state dict lacks {n!r}")

    return {
        n: to_megatron(n, get, arch, tp_rank=tp_rank, tp_size=tp_size, layer_offset=layer_offset,
                       expert_offset=expert_offset)
        for n in megatron_names if is_weight(n)
    }


# ------------------------------------------------------------------------------ Megatron -> HF
def to_hf(
    name: str, shards: Sequence[torch.Tensor], arch: Arch, *, layer_offset: int = 0,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """The HF tensors of Megatron parameter `name`, from its shards on every TP rank (in order).

    A tied model's `output_layer.weight` copy (pipeline last stage) yields nothing: the
    embedding already carries it.
    """
    kind, names = _rule(name, arch, layer_offset, expert_offset)
    if name == "output_layer.weight" and arch.tied_embeddings:
        return {}
    if kind == "replicated":
        return {names[0]: shards[0]}
    if kind in ("col", "row"):
        return {names[0]: torch.cat(list(shards), dim=0 if kind == "col" else 1)}
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves], dim=0),
                names[1]: torch.cat([h[1] for h in halves], dim=0)}
    ng, hd, hpg = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
    full = torch.cat(list(shards), dim=0)
    rest = full.shape[1:]
    if full.shape[0] != ng * (hpg + 2) * hd:
        raise ConversionError(f"{name}: {full.shape[0]} rows, expected {ng * (hpg + 2) * hd}")
    q, k, v = full.reshape(ng, (hpg + 2) * hd, *rest).split([hpg * hd, hd, hd], dim=1)
    return {names[0]: q.reshape(-1, *rest), names[1]: k.reshape(-1, *rest),
            names[2]: v.reshape(-1, *rest)}


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: Arch, *, layer_offset: int = 0,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """A HF state dict from the Megatron state dicts of all TP ranks (in rank order); of one
    expert-parallel rank's experts (`expert_offset`: its first global expert)."""
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if is_weight(name):
            out.update(to_hf(name, [s[name] for s in shards], arch, layer_offset=layer_offset,
                             expert_offset=expert_offset))
    return out


def expected_hf_names(arch: Arch) -> list[str]:
    """Every tensor a HF checkpoint of `arch` holds (what an export must write)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tied_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight")]
        if arch.num_experts:
            names.append(p + "mlp.gate.weight")
            names += [p + f"mlp.experts.{e}.{x}_proj.weight" for e in range(arch.num_experts)
                      for x in ("gate", "up", "down")]
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def megatron_names(arch: Arch, *, transformer_engine: bool = False) -> list[str]:
    """The weight names of a single-stage `GPTModel` of `arch` (local or TE layer spec)."""
    names = ["embedding.word_embeddings.weight"]
    in_norm, mlp_norm = (("self_attention.linear_qkv.layer_norm_weight",
                          "mlp.linear_fc1.layer_norm_weight") if transformer_engine
                         else ("input_layernorm.weight", "pre_mlp_layernorm.weight"))
    if arch.num_experts:  # the MoE specs keep a separate pre-MLP norm, TE's too
        mlp_norm = "pre_mlp_layernorm.weight"
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + in_norm, p + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [p + "self_attention.q_layernorm.weight",
                      p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + mlp_norm]
        if arch.num_experts:
            names.append(p + "mlp.router.weight")
            names += [p + f"mlp.experts.local_experts.{e}.linear_fc{i}.weight"
                      for e in range(arch.num_experts) for i in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not arch.tied_embeddings:
        names.append("output_layer.weight")
    return names


_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def from_fused(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """HF checkpoint tensor `name` out of an in-memory transformers state dict, or None.
    transformers 5 keeps a Qwen3-MoE's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) where the checkpoint names each expert's matrices."""
    if name in state:
        return state[name]
    m = _FUSED.match(name)
    if m is None:
        return None
    stem, expert, part = m.group(1), int(m.group(2)), m.group(3)
    if part == "down":
        fused = state.get(f"{stem}.down_proj")
        return None if fused is None else fused[expert]
    fused = state.get(f"{stem}.gate_up_proj")
    return None if fused is None else fused[expert].chunk(2)[0 if part == "gate" else 1]


def _chunk(t: torch.Tensor, n: int, dim: int, name: str) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % n:
        raise ConversionError(f"{name}: dim {dim} of size {t.shape[dim]} does not split {n} ways")
    return t.chunk(n, dim=dim)


def _expect(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ConversionError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
