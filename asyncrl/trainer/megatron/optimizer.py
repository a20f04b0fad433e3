"""The Megatron trainer's two optimizers, one interface (`zero_grad`, `step(lr, clip) -> grad
norm`, `state_for_save`, `load`, and `module`: what the forward pass calls).

Owns: the update of this rank's shards. `MegatronOptimizer` (CUDA): megatron's DDP (grad buckets
in fp32, reduced over DP) and megatron's optimizer (AdamW, fp32 master weights for bf16 models,
`distributed_optimizer` shards its state over DP, global-norm clip done inside). Weight decay
applies to every parameter, as in the torch trainer (megatron's default would skip norms and
biases). `TorchOptimizer` (no CUDA: megatron's DDP and optimizers hard-code it): plain torch
AdamW with float32 masters for bf16 weights, one all-reduce of the flattened gradients over DP
and a TP-aware global gradient norm (replicated parameters counted once). Under expert
parallelism the experts' weights (megatron marks them `allreduce = False`) are averaged over
the expert-data-parallel group instead, and each expert counts once in the norm: as megatron's
DDP and its chained optimizer do on CUDA. Does not own the loss, the schedule (the caller
passes `lr`) or where state files live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
from asyncrl.trainer.megatron import model as mmodel


class TorchOptimizer:
    """torch AdamW over this rank's shards; DP all-reduce and TP-aware clipping by hand.

    Mixed precision as megatron's optimizer does it: a parameter held in bf16 gets a float32
    master copy that AdamW updates (with the gradient in float32), copied back after each step;
    float32 parameters are their own masters (`masters[i] is params[i]`)."""

    def __init__(self, model: Any, algo: AlgorithmSection) -> None:
        self.module = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in self.params]
        # Qwen3's q/k norm weights are replicated over TP, but each rank only sees its own
        # heads: their gradients are partial sums (megatron's finalize_model_grads sums them).
        self._tp_partial = [i for i, (n, _) in enumerate(named)
                            if "q_layernorm" in n or "k_layernorm" in n]
        # Expert-parallel experts (megatron-core sets `allreduce = False` on them when
        # expert_model_parallel_size > 1): each EP rank holds different experts, whose
        # gradients already sum every EP rank's tokens (the token dispatcher's backward).
        self._experts = [i for i, p in enumerate(self.params) if not getattr(p, "allreduce", True)]
        self.opt = torch.optim.AdamW(self.masters, lr=algo.lr,
                                     betas=(algo.betas[0], algo.betas[1]),
                                     weight_decay=algo.weight_decay)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def step(self, lr: float, clip: float) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # Every parameter of a GPT model takes part in every forward, so a missing gradient
        # only means "zero" (a rank whose share was a dummy micro-batch still has all of them).
        grads = [p.grad.float() if p.grad is not None else torch.zeros_like(m)
                 for p, m in zip(self.params, self.masters, strict=True)]
        if ps.get_tensor_model_parallel_world_size() > 1 and self._tp_partial:
            _all_reduce_([grads[i] for i in self._tp_partial], ps.get_tensor_model_parallel_group())
        experts = set(self._experts)
        dense = [g for i, g in enumerate(grads) if i not in experts]
        dp = ps.get_data_parallel_world_size()
        if dp > 1:  # average over replicas, as DDP would
            _all_reduce_(dense, ps.get_data_parallel_group(), scale=1.0 / dp)
        if experts:
            # Summed over the replicas of these experts, divided by the dense DP size (each
            # micro-batch loss was multiplied by it): megatron DDP's expert gradient scaling.
            edp = ps.get_expert_data_parallel_world_size()
            own = [grads[i] for i in self._experts]
            if edp > 1:
                _all_reduce_(own, ps.get_expert_data_parallel_group(), scale=1.0 / dp)
            elif dp > 1:
                for g in own:
                    g.mul_(1.0 / dp)
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            if i not in experts and param_is_not_tensor_parallel_duplicate(p):
                sq += torch.linalg.vector_norm(g) ** 2
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sq, group=ps.get_tensor_model_parallel_group())
        if experts:  # each expert once: summed over the ranks that hold different experts
            esq = sum((torch.linalg.vector_norm(grads[i]) ** 2 for i in self._experts),
                      torch.zeros_like(sq))
            dist.all_reduce(esq, group=ps.get_expert_tensor_and_model_parallel_group())
            sq = sq + esq
        norm = sq.sqrt()
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
        for m, g in zip(self.masters, grads, strict=True):
            g.mul_(coef)
            m.grad = g
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.zero_grad()
        self._copy_masters()
        return float(norm)

    @torch.no_grad()
    def _copy_masters(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                p.copy_(m)

    def state_for_save(self, path: Path, layout: mmodel.Layout) -> Any:
        masters = {i: m for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True))
                   if m is not p}
        return {"adamw": self.opt.state_dict(), "masters": masters}

    @torch.no_grad()
    def load(self, state: Any, path: Path, layout: mmodel.Layout) -> None:
        self.opt.load_state_dict(state["adamw"])
        for i, m in enumerate(self.masters):
            if m is not self.params[i]:
                m.copy_(state["masters"][i] if i in state["masters"] else self.params[i])


class MegatronOptimizer:
    """megatron DDP + megatron AdamW (fp32 master weights; optionally DP-sharded state)."""

    def __init__(self, model: Any, algo: AlgorithmSection, cfg: MegatronTrainerConfig,
                 dtype: str) -> None:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.distributed = cfg.distributed_optimizer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.distributed_optimizer)
        self.module = DDP(config=model.config, ddp_config=ddp_cfg, module=model)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=algo.lr, weight_decay=algo.weight_decay,
            adam_beta1=algo.betas[0], adam_beta2=algo.betas[1], adam_eps=1e-8,
            clip_grad=algo.grad_clip, bf16=dtype == "bfloat16",
            params_dtype=mmodel.DTYPES[dtype], use_distributed_optimizer=cfg.distributed_optimizer)
        # `config_overrides={}`: weight decay on every parameter, like the torch trainer.
        self.opt = get_megatron_optimizer(opt_cfg, [self.module], config_overrides={})

    def zero_grad(self) -> None:
        self.module.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, lr: float, clip: float) -> float:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.module])  # DP reduce of the grad buckets
        for group in self.opt.param_groups:
            group["lr"] = lr
        _ok, norm, _zeros = self.opt.step()
        self.zero_grad()
        return float(norm or 0.0)

    def _param_file(self, path: Path, layout: mmodel.Layout) -> Path:
        # Under expert parallelism the experts' optimizer writes from each EP rank's first
        # expert replica: one file per (TP, EP) rank, as the model shards.
        ep = f"_ep{layout.ep_rank:02d}" if layout.ep_size > 1 else ""
        return path / f"megatron_tp{layout.tp_rank:02d}{ep}_optim_params.pt"

    def state_for_save(self, path: Path, layout: mmodel.Layout) -> Any:
        if self.distributed:  # collective over DP; DP rank 0 writes the gathered state
            path.mkdir(parents=True, exist_ok=True)
            self.opt.save_parameter_state(str(self._param_file(path, layout)))
        return self.opt.state_dict()

    def load(self, state: Any, path: Path, layout: mmodel.Layout) -> None:
        self.opt.load_state_dict(state)
        # Without TE/Apex megatron runs torch's AdamW, whose per-parameter state holds a
        # "step". megatron-core 0.16 gives every parameter the *same* step tensor on load (so
        # torch's in-place `step += 1` would count once per parameter), and its
        # `load_parameter_state` copies every state key from the file, which has no "step"
        # (KeyError). Hold the steps aside while the parameter state loads, then give each
        # parameter its own copy.
        states = [s for o in getattr(self.opt, "chained_optimizers", [self.opt])
                  for s in o.optimizer.state.values()]
        steps = [s.pop("step", None) for s in states]
        try:
            if self.distributed:
                # no_grad: an fp32 model's main params are views of its parameters, which
                # megatron copies into in place (outside no_grad autograd refuses that)
                with torch.no_grad():
                    self.opt.load_parameter_state(str(self._param_file(path, layout)))
        finally:
            for s, step in zip(states, steps, strict=True):
                if step is not None:
                    s["step"] = step.clone() if isinstance(step, torch.Tensor) else step


def _all_reduce_(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    """Sum `tensors` in place over `group` with one collective, then multiply by `scale`."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat *= scale
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
