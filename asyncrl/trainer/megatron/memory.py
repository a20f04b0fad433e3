"""GPU memory estimates for one rank of the Megatron trainer, and the recompute choice they
drive (`trainer.recompute = "auto"`).

Owns: pure arithmetic over an `Arch` and the run's shape; nothing here touches a device. Does
not own how recompute is configured in megatron (`model.build_gpt`).

The model (bytes per parameter on this rank, parameters split over TP):
- weights in the training dtype (2 B in bf16, 4 B in fp32);
- megatron's DDP gradient buffer in float32 (`grad_reduce_in_fp32`): 4 B;
- optimizer: Adam's two moments in float32 (8 B), plus a float32 master copy when the weights
  are bf16 (4 B); divided by the data-parallel size with the distributed optimizer.
  bf16: 2 + 4 + 12 / dp = 18 B at dp = 1 (0.6B: 10.8 GB, 1.7B: 37 GB, 4B: 72 GB).

Activations kept for backward, per token and layer, in elements of the training dtype (fused
core attention: SDPA or TE, which keep q, k, v, the output and a log-sum-exp, never the
[s, s] scores), with h = hidden, q = heads x head_dim, kv = KV heads x head_dim, f = FFN width,
each split over TP except the norms' h:
- input norm in/out 2h; q/k norms and RoPE inputs 2(q + kv); SDPA's q, k, v and output
  2q + 2kv; pre-MLP norm in/out 2h; fc1 output 2f and the SwiGLU output f.
- selective recompute (megatron's `recompute_modules=["mlp"]`) keeps the MLP's input only,
  dropping 3f and the pre-MLP norm's output h; full recompute keeps each layer's input (h).
Plus the vocabulary path of one micro-batch: the [tokens, V / tp] logits, their transposed
copy and their gradient, in the training dtype.

The optimizer step, after the activations are gone, adds a transient: without TE/Apex megatron
runs torch's foreach AdamW, whose `_foreach_sqrt` of the second moments allocates a float32
copy of them (4 B per parameter on this rank). So a 4B model in bf16 on one 80 GB GPU
(72 GB of state, 16 GB at the step) does not fit at any recompute setting: it needs its
optimizer state sharded (DP) or offloaded, or TP.

These are estimates (allocator fragmentation, collective buffers and torch.compile workspaces
come on top), so `choose_recompute` leaves `HEADROOM` of the device free.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.trainer.megatron.arch import Arch

HEADROOM = 0.15
"""Fraction of device memory `choose_recompute` keeps free for what the estimate leaves out."""

RECOMPUTE_ORDER = ("none", "selective", "full")
"""Cheapest first: the first that fits is chosen."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank."""

    weights_and_optimizer: float
    activations: float
    logits: float
    optimizer_step: float

    @property
    def total(self) -> float:
        """The peak: the larger of the micro-batch's and the optimizer step's."""
        return self.weights_and_optimizer + max(self.activations + self.logits,
                                                self.optimizer_step)


def estimate(arch: Arch, *, micro_batch_tokens: int, recompute: str, bf16: bool, tp: int = 1,
             dp: int = 1, distributed_optimizer: bool = True) -> MemoryEstimate:
    """Peak-memory estimate of one training micro-batch (see the module doc for the model)."""
    if recompute not in RECOMPUTE_ORDER:
        raise ValueError(f"recompute: {recompute!r} is not one of {RECOMPUTE_ORDER}")
    width = 2 if bf16 else 4
    params = arch.num_params() / tp
    shards = dp if distributed_optimizer else 1
    opt = (12.0 if bf16 else 8.0) / shards
    static = params * (width + 4 + opt)

    h = float(arch.hidden_size)
    q = arch.num_heads * arch.head_dim / tp
    kv = max(1, arch.num_kv_heads // tp) * arch.head_dim
    f = arch.ffn_hidden_size / tp
    if recompute == "full":
        per_layer = h
    else:
        per_layer = 2 * h + 2 * (q + kv) + 2 * q + 2 * kv + h
        if recompute == "none":
            per_layer += h + 3 * f
    activations = per_layer * arch.num_layers * micro_batch_tokens * width
    logits = 3.0 * micro_batch_tokens * arch.vocab_size / tp * width
    return MemoryEstimate(static, activations, logits, optimizer_step=4.0 * params / shards)


def choose_recompute(arch: Arch, *, device_bytes: float, micro_batch_tokens: int, bf16: bool,
                     tp: int = 1, dp: int = 1, distributed_optimizer: bool = True
                     ) -> tuple[str, MemoryEstimate, bool]:
    """(recompute, its estimate, whether it fits): the cheapest recompute whose estimate fits in
    `device_bytes` less `HEADROOM`, else `full`, which may not fit either (the model and its
    optimizer state alone may be too big)."""
    budget = device_bytes * (1.0 - HEADROOM)
    need = None
    for kind in RECOMPUTE_ORDER:
        need = estimate(arch, micro_batch_tokens=micro_batch_tokens, recompute=kind, bf16=bf16,
                        tp=tp, dp=dp, distributed_optimizer=distributed_optimizer)
        if need.total <= budget:
            return kind, need, True
    assert need is not None
    return "full", need, False
