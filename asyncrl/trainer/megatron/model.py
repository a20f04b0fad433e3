"""A megatron-core `GPTModel` for a HF architecture: process groups, build, weights in and out,
and vocab-parallel token log-probabilities.

Owns: importing megatron-core (with a clear error when it is missing), initialising its
parallel state on top of torch.distributed (tensor, pipeline, data and expert parallel),
building the model from an `Arch`, copying HF weights into this rank's shards (its TP slice
and, under expert parallelism, its run of experts), streaming this model's weights back out
as whole HF tensors (gathered over the tensor-parallel group, experts over the
expert-parallel group), and the forward pass to vocabulary-split logits.

Does not own: the name/layout map (`convert.py`), log-probabilities over the split vocabulary
(`vocab_parallel.py`), the update step (`trainer.py`), files (`hf_files.py`). Runs on CUDA, or on the CPU over gloo with `cpu_compat`'s patches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.errors import ConfigError
from asyncrl.trainer.megatron import convert
from asyncrl.trainer.megatron.arch import Arch
from asyncrl.trainer.megatron.errors import MegatronUnavailableError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def require_megatron() -> None:
    """Import megatron-core or raise `MegatronUnavailableError` saying how to install it."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MegatronUnavailableError(
            f"trainer.kind = \"megatron\" needs megatron-core ({e}); "
            "install it with `pip install 'asyncrl[gpu]'` or `pip install megatron-core==0.16.0`"
        ) from None


# ------------------------------------------------------------------------------ process groups
@dataclass(frozen=True)
class Layout:
    """This rank's place in the tensor x pipeline x data parallel grid, and in the expert
    parallel one (the MoE layers' experts split `ep_size` ways over ranks that are data
    parallel for everything else; `edp`: the replicas of this rank's experts)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    ep_rank: int = 0
    ep_size: int = 1
    edp_rank: int = 0
    edp_size: int = 1


def check_expert_parallel(arch: Arch, ep: int, *, tp: int = 1, pp: int = 1,
                          world_size: int | None = None) -> None:
    """Refuse an `expert_parallel` size (`trainer.expert_parallel`) this model or world cannot
    take, before any process group is made: a dense model, experts it does not divide, a
    world (from torchrun's `WORLD_SIZE` unless given) it does not divide with TP x PP."""
    if ep == 1:
        return
    key = "trainer.expert_parallel"
    if not arch.num_experts:
        raise ConfigError(key, f"{ep}, but the model ({arch.model_type}) is dense: it has no "
                          "experts to split; use 1")
    if arch.num_experts % ep:
        raise ConfigError(key, f"{ep} does not divide the model's {arch.num_experts} experts")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(
            os.environ.get("WORLD_SIZE", "1"))
    if world_size % (ep * tp * pp):
        raise ConfigError(key, f"{ep} x tensor_parallel {tp} x pipeline_parallel {pp} does not "
                          f"divide the world of {world_size} rank(s); start the run under "
                          f"torchrun with a multiple of {ep * tp * pp} processes "
                          "(python -m asyncrl.cli.launch, docs/multinode.md)")


def init_parallel(tp: int, pp: int, seed: int, *, ep: int = 1,
                  timeout_minutes: int = 30) -> Layout:
    """Set up torch.distributed (if not yet) and megatron's parallel state; seed its RNGs.
    `ep`: expert-parallel size (megatron's `expert_model_parallel_size`).

    Under torchrun the usual env (RANK, WORLD_SIZE, MASTER_ADDR, LOCAL_RANK) is read; a lone
    process gets a world of one. NCCL on CUDA; gloo otherwise, with megatron-core patched for
    the CPU (`cpu_compat.install_for_process`).
    """
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from asyncrl.trainer.megatron.cpu_compat import install_for_process

        install_for_process()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"megatron parallel state is (tp, pp, ep)={have}, asked for "
                               f"{(tp, pp, ep)}")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_minutes,
        )
    model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        edp_size=ps.get_expert_data_parallel_world_size(),
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups (and torch.distributed if this module started it)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- building
def use_transformer_engine() -> bool:
    """TE layers (fused attention and norms) when TE is installed and CUDA is there."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


ATTENTION_KINDS = ("auto", "te", "sdpa", "local")
"""Core attentions `build_gpt` can put in the layer spec: `te` (Transformer Engine's spec),
`sdpa` (the local spec with `sdpa_attention.SDPACoreAttention`), `local` (megatron-core's own
`DotProductAttention`: materialised scores; kept for equivalence tests and A/B benchmarks),
`auto` (`te` when `use_transformer_engine()`, else `sdpa`)."""


def resolve_attention(attention: str) -> str:
    """The concrete core attention for `attention` (one of `ATTENTION_KINDS`)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention: {attention!r} is not one of {ATTENTION_KINDS}")
    if attention == "auto":
        return "te" if use_transformer_engine() else "sdpa"
    if attention == "te" and not use_transformer_engine():
        raise MegatronUnavailableError("attention = \"te\" needs transformer_engine and CUDA")
    return attention


def _layer_spec(attention: str, qk_norm: bool, num_experts: int | None = None) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if attention == "te":
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                          qk_layernorm=qk_norm)
    if attention == "sdpa":
        from asyncrl.trainer.megatron.sdpa_attention import local_spec

        return local_spec(qk_norm, num_experts)
    return get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_norm,
                                    normalization="RMSNorm")


def _router_without_te() -> None:
    """megatron-core 0.16's router gating linear tests `te_general_gemm is not None` but
    `moe_utils` defines that name only when Transformer Engine imports: without TE, on a GPU
    as on a CPU, every MoE forward was a `NameError` (the H200 sweep of 2026-11-29). Defined as
    None, the plain-torch branch runs; left alone when TE defined it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _recompute_kwargs(recompute: str, attention: str) -> dict[str, Any]:
    """megatron's recompute settings. `selective` recomputes what is cheap to redo and costly
    to keep: the core attention when it materialises [b, h, s, s] scores (`local`), else the
    MLP (a fused attention keeps only q, k, v, its output and a log-sum-exp, so recomputing it
    would save almost nothing)."""
    if recompute == "selective":
        return {"recompute_granularity": "selective",
                "recompute_modules": ["core_attn"] if attention == "local" else ["mlp"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    if recompute != "none":
        raise ValueError(f"recompute: {recompute!r} is not one of none, selective, full")
    return {}


def build_gpt(
    arch: Arch,
    *,
    dtype: str = "float32",
    recompute: str = "none",
    init_std: float = 0.02,
    attention: str = "auto",
    routing_replay: bool = False,
) -> Any:
    """A `GPTModel` holding this rank's shard of `arch`, randomly initialised (normal with
    `init_std`); parallel state must be initialised. The vocabulary stays split over TP in the
    output (`parallel_output=True`), which `vocab_parallel` relies on. `attention` picks the
    core attention (`ATTENTION_KINDS`).

    Every parameter is in `dtype` afterwards, norms included: megatron builds linears and
    embeddings in `params_dtype` but the local spec's `torch.nn.RMSNorm` in float32, which
    beside bf16 activations takes torch's composite (unfused, casting) RMSNorm in every layer.
    The cast is what megatron-LM's `Float16Module` does to the model it wraps (without its
    float32 cast of the output logits); the float32 master copy of every weight, norms now
    included, is kept by megatron's mixed-precision / distributed optimizer.

    Always initialised, even when HF weights will overwrite it: megatron-core marks a weight as
    tensor-parallel (what its grad-norm and checkpointing read) only in its init functions.
    """
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    arch.check_parallel(tp, pp)
    check_expert_parallel(arch, ep, tp=tp, pp=pp)
    params_dtype = DTYPES[dtype]
    attention = resolve_attention(attention)
    cuda = torch.cuda.is_available()
    config = TransformerConfig(
        **arch.transformer_config_kwargs(),
        activation_func=F.silu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype is torch.bfloat16,
        fp16=params_dtype is torch.float16,
        use_cpu_initialization=not cuda,
        perform_initialization=True,
        init_method_std=init_std,
        # SwiGLU through megatron's `bias_swiglu_impl`, whose `@jit_fuser` is torch.compile:
        # CUDA only (on CPU inductor would need a C++ compiler at run time).
        bias_activation_fusion=cuda,
        # The rest need apex/TE kernels.
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # MoE: the all-to-all dispatcher makes CUDA streams; all-gather runs anywhere
        **({"moe_token_dispatcher_type": "alltoall" if cuda else "allgather",
            "moe_enable_routing_replay": routing_replay,
            "expert_model_parallel_size": ep} if arch.num_experts else {}),
        **_recompute_kwargs(recompute, attention),
    )
    if arch.num_experts:
        _router_without_te()
    model = GPTModel(
        config, _layer_spec(attention, arch.qk_norm, arch.num_experts or None),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        **arch.gpt_model_kwargs(),
    )
    model.to(dtype=params_dtype)
    if cuda:
        model.cuda(torch.cuda.current_device())
    return model


def core_attention(model: Any) -> str:
    """Which core attention a built model uses: `te`, `sdpa` or `local`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from asyncrl.trainer.megatron.sdpa_attention import SDPACoreAttention

    while not hasattr(model, "decoder") and hasattr(model, "module"):  # DDP / Float16Module
        model = model.module
    layers = getattr(model.decoder, "layers", [])
    if not len(layers):
        return "sdpa"
    core = layers[0].self_attention.core_attention
    if isinstance(core, SDPACoreAttention):
        return "sdpa"
    return "local" if isinstance(core, DotProductAttention) else "te"


def layer_offset(model: Any) -> int:
    """Global index of this pipeline stage's first layer."""
    layers = getattr(model.decoder, "layers", [])
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def weight_names(model: Any) -> list[str]:
    """Megatron state-dict names that hold weights, in module order."""
    return [n for n in model.state_dict() if convert.is_weight(n)]


def expert_offset(arch: Arch) -> int:
    """Global index of this rank's first expert (expert-parallel ranks hold consecutive
    runs, as megatron's `BaseMoELayer.local_expert_indices`); 0 for a dense model."""
    from megatron.core import parallel_state as ps

    if not arch.num_experts:
        return 0
    ep = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * (arch.num_experts // ep)


# ---------------------------------------------------------------------------- weights in/out
@torch.no_grad()
def load_hf_weights(model: Any, arch: Arch, get_hf: Callable[[str], torch.Tensor]) -> None:
    """Fill this rank's shards from HF tensors (`get_hf(name)` returns a whole HF tensor)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    offset, experts = layer_offset(model), expert_offset(arch)
    state = model.state_dict(keep_vars=True)
    for name in weight_names(model):
        shard = convert.to_megatron(name, get_hf, arch, tp_rank=tp_rank, tp_size=tp_size,
                                    layer_offset=offset, expert_offset=experts)
        target = state[name]
        if tuple(target.shape) != tuple(shard.shape):
            raise convert.ConversionError(
                f"{name}: built shape {tuple(target.shape)}, converted {tuple(shard.shape)}"
            )
        target.data.copy_(shard.to(device=target.device, dtype=target.dtype))


@torch.no_grad()
def iter_hf_weights(model: Any, arch: Arch, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights as whole HF tensors, one parameter at a time: every
    expert of the model, not only this rank's.

    Collective over the TP group and, for a mixture of experts split over expert-parallel
    ranks, the EP group: every rank of both must iterate to the end; all of them receive the
    gathered tensors (on the model's device; the caller moves them). Replicated tensors
    (norms, routers) are not gathered. Under expert parallelism each local expert's matrix is
    gathered from every EP rank and yields that many experts (`expert_offset` apart).
    """
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size() if arch.num_experts else 1
    local_experts = arch.num_experts // ep if ep > 1 else 0
    offset = layer_offset(model)
    state = model.state_dict()
    for name in weight_names(model):
        local = state[name]
        if dtype is not None:
            local = local.to(dtype)
        if local_experts and convert.is_expert(name):
            # TP of an MoE model is refused (`Arch.check_parallel`): whole matrices here
            runs = [torch.empty_like(local) for _ in range(ep)]
            dist.all_gather(runs, local.contiguous(), group=ps.get_expert_model_parallel_group())
            for r, t in enumerate(runs):
                yield from convert.to_hf(name, [t], arch, layer_offset=offset,
                                         expert_offset=r * local_experts).items()
            continue
        if tp == 1 or convert.split_kind(name, arch) == "replicated":
            shards = [local] * tp
        else:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=group)
        yield from convert.to_hf(name, shards, arch, layer_offset=offset).items()


# ---------------------------------------------------------------------------------- forward
def common_shape(rows: int, width: int, device: torch.device) -> tuple[int, int]:
    """The `[rows, width]` every rank of this rank's expert-parallel group pads its next
    micro-batch to: the largest over the group (collective there; `(rows, width)` itself
    without expert parallelism). megatron-core's all-gather token dispatcher gathers each MoE
    layer's tokens over that group into a tensor of `group size x tokens`, so every rank must
    bring the same number; extra rows and columns are padding (loss mask 0), which a causal,
    dropless MoE model computes apart from the real tokens."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return rows, width
    shape = torch.tensor([rows, width], dtype=torch.long, device=device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX,
                    group=ps.get_expert_tensor_and_model_parallel_group())
    return int(shape[0]), int(shape[1])


def causal_mask(model: Any, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """The attention mask (True = masked) to pass `model`: None for the fused cores (SDPA and
    TE build the causal mask inside the kernel); an explicit one for megatron's
    `DotProductAttention`, whose default mask is always built on "cuda"."""
    if core_attention(model) != "local":
        return None
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def forward_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits `[batch, seq, vocab / tp]` (this rank's vocabulary slice) for right-padded rows.

    Right padding needs no padding mask: causal attention keeps pad tokens out of every real
    position, and the loss masks the padded positions. (Megatron's RoPE ignores position ids
    and numbers positions from 0, so sequences cannot be packed into one row here.)
    """
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids, position_ids, causal_mask(model, s, input_ids.device))
