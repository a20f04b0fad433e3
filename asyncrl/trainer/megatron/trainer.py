"""The Megatron trainer: `trainer.kind = "megatron"` behind the `asyncrl.trainer.base.Trainer`
interface, with tensor and data parallelism from megatron-core.

Owns: turning a HF model (object or directory) into a sharded megatron-core `GPTModel`, how a
micro-batch becomes tensors and (vocab-parallel) log-probs on it, the optimizer, weight export
(HF names, gathered over TP) and trainer state. Shares with the torch trainer, not copies: the
RL and SFT steps (`asyncrl.algo.step`; this trainer is their `StepBackend`), batching, sharding
and packing (`asyncrl.algo.batching`), `grpo_loss` / `sft_loss` / `offpolicy` corrections and
mismatch metrics / `StepStats` (`asyncrl.algo.loss`) and the lr schedule
(`asyncrl.algo.schedule`). Does not own the loop, RoC, or how other ranks receive their calls
(`launch.py`).

Layout: world = TP x PP x DP (PP = 1 for now). Each mini-batch is sharded over the DP ranks by
`batching.shard`; all TP ranks of a replica see the same micro-batches. A packed micro-batch
is unpacked into right-padded rows (megatron's RoPE cannot restart positions inside a row);
padding is masked out of the loss. Loss of a micro-batch = token sum / trained tokens of the
whole mini-batch (all ranks), times the DP size because gradients are averaged over DP, so an
update equals the single-process update on the whole batch up to float summation order —
the same contract as the torch trainer, whose update this one reproduces (tests check it).

Optimizer (`optimizer.py`): megatron's DDP and mixed-precision / distributed optimizer on
CUDA (`use_megatron_optimizer`), plain torch AdamW with explicit collectives otherwise.

The model itself is in the training dtype, norms included (`model.build_gpt`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.algo import batching, offpolicy, step
from asyncrl.algo.batching import Packed, TrainSeq
from asyncrl.algo.loss import StepStats
from asyncrl.algo.schedule import lr_factor
from asyncrl.algo.step import GiveUp
from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
from asyncrl.errors import TrainerError
from asyncrl.log import get_logger
from asyncrl.modeling import routing_replay
from asyncrl.records import Batch
from asyncrl.trainer import moe_replay
from asyncrl.trainer.megatron import convert, vocab_parallel
from asyncrl.trainer.megatron import model as mmodel
from asyncrl.trainer.megatron.arch import Arch
from asyncrl.trainer.megatron.optimizer import MegatronOptimizer, TorchOptimizer
from asyncrl.trainer.megatron.replay import MegatronReplay

log = get_logger(__name__)


class MegatronTrainer:
    """Implements `asyncrl.trainer.base.Trainer` on a megatron-core GPT model, and
    `asyncrl.algo.step.StepBackend` for the shared steps.

    `model` is a HF `PreTrainedModel` (its weights are copied; tiny runs and tests), the path
    of a HF directory (each rank reads only the tensors it needs, one at a time), or a HF
    `PretrainedConfig` (random initialisation; benchmarks). `dtype` defaults to the HF
    model's dtype. `temperature` and `total_steps` as in `TorchTrainer`. `attention` picks the
    core attention (`model.ATTENTION_KINDS`; `auto`: TE when installed, else torch SDPA).
    Every rank constructs the trainer with the same arguments (see `launch.py`).
    """

    def __init__(self, model: Any, cfg: MegatronTrainerConfig, algo: AlgorithmSection,
                 pad_token_id: int, *, temperature: float = 1.0,
                 total_steps: int | None = None, seed: int = 0, dtype: str | None = None,
                 attention: str = "auto") -> None:
        if cfg.pipeline_parallel != 1:
            raise TrainerError("trainer.pipeline_parallel: only 1 is implemented so far")
        if algo.lr_schedule == "cosine" and not total_steps:
            raise TrainerError("algorithm.lr_schedule = cosine needs total_steps")
        mmodel.require_megatron()
        self.cfg, self.algo = cfg, algo
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.total_steps = total_steps
        hf_config, get_hf, src_dtype = _hf_source(model)
        self.hf_config = hf_config
        self.dtype = dtype or src_dtype
        if self.dtype == "float16":
            raise TrainerError("model.dtype: float16 is not supported by the megatron trainer "
                               "(no loss scaling); use bfloat16")
        self.arch = Arch.from_hf(hf_config)
        replay = routing_replay(algo.routing_replay, hf_config)
        mmodel.check_expert_parallel(self.arch, cfg.expert_parallel, tp=cfg.tensor_parallel,
                                     pp=cfg.pipeline_parallel)
        self.layout = mmodel.init_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, seed,
                                           ep=cfg.expert_parallel)
        self.device = self.layout.device
        self.recompute = self._recompute(cfg)
        self._attention = attention
        self.model = mmodel.build_gpt(self.arch, dtype=self.dtype, recompute=self.recompute,
                                      attention=attention, routing_replay=replay)
        self.replay = MegatronReplay(self.model) if replay else None
        """Routing replay through megatron-core's router replay (`megatron/replay.py`)."""
        self.reference: Any = None
        """Frozen copy of this rank's shard at the first RL update (`algorithm.kl_coef`)."""
        self._reference_replay: MegatronReplay | None = None
        """The reference's routers replaying the same records as the policy's."""
        if get_hf is not None:
            mmodel.load_hf_weights(self.model, self.arch, get_hf)
        self.model.train()
        if use_megatron_optimizer():
            self._opt: TorchOptimizer | MegatronOptimizer = MegatronOptimizer(
                self.model, algo, cfg, self.dtype)
        else:
            self._opt = TorchOptimizer(self.model, algo)
        self._base_lr = algo.lr
        self._opt_step = 0
        log.info("trainer_ready", kind="megatron", device=str(self.device),
                 world_size=self.layout.world_size, tp=self.layout.tp_size,
                 dp=self.layout.dp_size, ep=self.layout.ep_size,
                 optimizer=type(self._opt).__name__,
                 params=self.arch.num_params(), dtype=self.dtype, recompute=self.recompute,
                 attention=mmodel.core_attention(self.model))

    def _recompute(self, cfg: MegatronTrainerConfig) -> str:
        """`cfg.recompute`, with `auto` resolved from this GPU's memory (`memory.py`)."""
        if cfg.recompute != "auto":
            return cfg.recompute
        if not torch.cuda.is_available():
            return "none"
        from asyncrl.trainer.megatron import memory

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        kind, need, fits = memory.choose_recompute(
            self.arch, device_bytes=float(total), micro_batch_tokens=cfg.micro_batch_tokens,
            bf16=self.dtype == "bfloat16", tp=self.layout.tp_size, dp=self.layout.dp_size,
            distributed_optimizer=cfg.distributed_optimizer)
        if not fits:
            log.warning("memory_estimate_exceeds_device", recompute=kind,
                        estimate_gib=round(need.total / 2**30, 1),
                        device_gib=round(total / 2**30, 1))
        return kind

    # ------------------------------------------------- step hooks (`algo.step.StepBackend`)
    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    def accumulate(self, index: int, count: int) -> contextlib.AbstractContextManager[Any]:
        """Clears the gradients (megatron's DDP grad buffers) before the first micro-batch;
        they are reduced over DP once, in the optimizer step, so nothing to hold back."""
        if index == 0:
            self._opt.zero_grad()
        return contextlib.nullcontext()

    def plan(self, seqs: Sequence[TrainSeq]) -> list[Packed]:
        """This DP rank's micro-batches for one mini-batch, padded with dummies to the count
        of the busiest DP rank (every rank computes every rank's packing; no collective)."""
        dp, me = self.layout.dp_size, self.layout.dp_rank
        lengths = [s.num_tokens for s in seqs]
        counts, mine = [], []
        for r in range(dp):
            share = [seqs[i] for i in batching.shard(lengths, r, dp)]
            packed = batching.pack(share, self.cfg.micro_batch_tokens)
            counts.append(len(packed))
            if r == me:
                mine = packed
        n = max(1, *counts)
        return mine + [batching.dummy(self.pad_token_id)] * (n - len(mine))

    def tensors(self, mb: Packed) -> dict[str, torch.Tensor]:
        """A packed micro-batch as right-padded rows, one sequence per row `[n, longest]`;
        under expert parallelism padded further (rows and columns) to the largest shape of
        the expert-parallel group's micro-batches (`model.common_shape`; collective)."""
        starts = [0] + [i for i in range(1, mb.num_tokens)
                        if mb.seq_index[i] != mb.seq_index[i - 1]]
        spans = list(zip(starts, [*starts[1:], mb.num_tokens], strict=True))
        n, width = mmodel.common_shape(len(spans), max(e - s for s, e in spans), self.device)

        def rows(values: list[Any], fill: float, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full((n, width), fill, dtype=dtype)
            for r, (s, e) in enumerate(spans):
                out[r, : e - s] = torch.tensor(values[s:e], dtype=dtype)
            return out.to(self.device)

        extra = {}
        if self.replay is not None and mb.routed_experts:
            routes = moe_replay.routes(
                mb.routed_experts, [e - s for s, e in spans], width, [], self.arch.num_layers,
                self.arch.moe_top_k, self.device)
            extra["routes"] = torch.cat([routes, routes.new_full(
                ((n - len(spans)) * width, *routes.shape[1:]), -1)])
        return extra | {
            "input_ids": rows(mb.input_ids, self.pad_token_id, torch.long),
            "mask": rows(mb.loss_mask, 0, torch.float32),
            "advantages": rows(mb.advantages, 0.0, torch.float32),
            "sampling_logprobs": rows(mb.sampling_logprobs, 0.0, torch.float32),
            "lag": rows(mb.lags or [0] * mb.num_tokens, 0, torch.long),
        }

    def _logits(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.replay is not None:
            self.replay.set(t.get("routes"), *t["input_ids"].shape)
        return mmodel.forward_logits(self._opt.module, t["input_ids"])

    def logprobs(self, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Over the vocabulary split across TP ranks (`vocab_parallel`)."""
        return vocab_parallel.token_logprobs(self._logits(t), t["input_ids"], temperature)

    def logprobs_and_entropy(self, t: dict[str, torch.Tensor], temperature: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel.token_logprobs_and_entropy(self._logits(t), t["input_ids"],
                                                         temperature)

    def reference_logprobs(self, t: dict[str, torch.Tensor], temperature: float
                           ) -> torch.Tensor:
        """Log-probs under the frozen reference (`algorithm.kl_coef`): this rank's shard as it
        was at the first call, in a second `GPTModel` (see `StepBackend`)."""
        if self.reference is None:
            self.reference = self._frozen_copy()
        if self._reference_replay is not None:
            self._reference_replay.set(t.get("routes"), *t["input_ids"].shape)
        with torch.no_grad():
            logits = mmodel.forward_logits(self.reference, t["input_ids"])
            return vocab_parallel.token_logprobs(logits, t["input_ids"], temperature)

    def _frozen_copy(self) -> Any:
        """A second model of the same shard layout holding the current weights, no gradients
        (every rank builds its own shard at the same call). With routing replay its routers
        replay the records too, as the torch trainer's reference does: otherwise the KL
        penalty would measure the routing noise replay removes from the policy."""
        replay = self.replay is not None
        ref = mmodel.build_gpt(self.arch, dtype=self.dtype, recompute="none",
                               attention=self._attention, routing_replay=replay)
        self._reference_replay = MegatronReplay(ref) if replay else None
        ref.load_state_dict(self.model.state_dict())
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def discard_gradients(self) -> None:
        self._opt.zero_grad()

    def apply_gradients(self, lr_scale: float) -> tuple[float, float]:
        lr = self._base_lr * lr_scale * lr_factor(self._opt_step, self.algo.warmup_steps,
                                                  self.algo.lr_schedule, self.total_steps)
        norm = self._opt.step(lr, self.algo.grad_clip)
        self._opt_step += 1
        return norm, lr

    # ----------------------------------------------------------------------------- steps
    def train_step(self, batch: Batch, lr_scale: float = 1.0,
                   give_up: GiveUp = None) -> dict[str, float]:
        """One RL step (see `base.Trainer`, `algo.step.rl_step`). Blocking; every rank calls it
        with the batch. `give_up` is not asked: the ranks must take the same micro-batches,
        and a stop waits for the step's end."""
        out = step.rl_step(self, batch, self.algo, temperature=self.temperature,
                           lr_scale=lr_scale)
        if self.replay is not None:  # the reference's forwards count too, as in the torch trainer
            counts = self.replay.take_counts()
            if self._reference_replay is not None:
                counts = counts + self._reference_replay.take_counts()
            out.update(moe_replay.replay_metrics(counts, "train/"))
        return out

    def sft_step(self, examples: list[tuple[list[int], list[int]]],
                 give_up: GiveUp = None) -> dict[str, float]:
        """One optimizer step of masked cross-entropy, token-mean over all examples (`give_up`
        is not asked, as in `train_step`)."""
        return step.sft_step(self, examples)

    def sft_eval(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """Masked cross-entropy of `examples` without an update (a held-out loss)."""
        return step.sft_eval(self, examples)

    def reduce_metrics(self, stats: StepStats, prefix: str) -> dict[str, float]:
        """Metrics summed over all ranks. TP ranks hold copies of their replica's sums, which
        cancels in every `x_sum / tokens` mean and leaves maxima and minima alone; only the
        plain `tokens` count is divided back by the copies."""
        stats.reduce(self.device)
        out = stats.means(prefix)
        copies = self.layout.tp_size * self.layout.pp_size
        if f"{prefix}tokens" in out:
            out[f"{prefix}tokens"] /= copies
        return out

    def gather_replicas(self, x: torch.Tensor) -> torch.Tensor:
        """Over the data-parallel group: the replicas that hold this rank's tensor-parallel
        position (one copy of each replica's tokens)."""
        from megatron.core import parallel_state as ps

        return offpolicy.gather_1d(x, self.device, ps.get_data_parallel_group())

    # ---------------------------------------------------------------------- weights/state
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full weights by HF name, as fresh CPU tensors on rank 0 ({} on the others, which
        must call it too: the TP shards are gathered). CPU, so that gathering a large model
        never needs a second copy of it in GPU memory."""
        if not self._exports():
            return {}
        keep = self.layout.rank == 0
        out: dict[str, torch.Tensor] = {}
        for name, t in mmodel.iter_hf_weights(self.model, self.arch):
            if keep:
                out[name] = t.detach().to("cpu", copy=True)
        return out

    def export_hf(self, path: str | Path) -> None:
        """Write a HF model directory (safetensors shards, index, config) from rank 0, one
        gathered tensor at a time."""
        from asyncrl.trainer.megatron.hf_files import write_hf

        if self._exports():
            tensors = mmodel.iter_hf_weights(self.model, self.arch)
            if self.layout.rank == 0:
                write_hf(path, tensors, self.hf_config, dtype=mmodel.DTYPES[self.dtype])
            else:
                for _ in tensors:  # take part in the gathers
                    pass
        _barrier()

    def _exports(self) -> bool:
        """Whether this rank takes part in gathering whole HF tensors: DP replica 0; every
        rank under expert parallelism (the experts are gathered over the EP group, which
        spans DP replicas; other replicas' gathers are simply dropped)."""
        return self.layout.dp_rank == 0 or self.layout.ep_size > 1

    def _state_file(self, path: str | Path) -> Path:
        ep = f"_ep{self.layout.ep_rank:02d}" if self.layout.ep_size > 1 else ""
        return Path(path) / f"megatron_tp{self.layout.tp_rank:02d}{ep}.pt"

    def _writes_state(self) -> bool:
        """DP replica 0 writes the shards; under expert parallelism each EP rank's first
        expert replica (its experts are its own; the rest is the same on every replica)."""
        return (self.layout.edp_rank == 0 if self.layout.ep_size > 1
                else self.layout.dp_rank == 0)

    def save_state(self, path: str | Path) -> None:
        """Per TP (and EP) rank: model shard, optimizer and schedule (`_writes_state`)."""
        out = Path(path)
        opt_state = self._opt.state_for_save(out, self.layout)
        if self._writes_state():
            out.mkdir(parents=True, exist_ok=True)
            state = {"model": self.model.state_dict(), "optimizer": opt_state,
                     "schedule": {"opt_step": self._opt_step, "base_lr": self._base_lr},
                     "layout": {"tp": self.layout.tp_size, "pp": self.layout.pp_size,
                                "ep": self.layout.ep_size}}
            if self.reference is not None:
                state["reference"] = self.reference.state_dict()
            torch.save(state, self._state_file(out))
        _barrier()

    def load_state(self, path: str | Path) -> None:
        """Restore what `save_state` wrote, for the same TP and EP sizes (every rank reads its
        file)."""
        file = self._state_file(path)
        try:
            state = torch.load(file, map_location=self.device, weights_only=False)
        except (OSError, RuntimeError) as e:
            raise TrainerError(f"cannot read trainer state {file}: {e}") from e
        if state["layout"]["tp"] != self.layout.tp_size:
            raise TrainerError(f"{file}: saved with tensor_parallel={state['layout']['tp']}, "
                               f"running with {self.layout.tp_size}")
        if state["layout"].get("ep", 1) != self.layout.ep_size:
            raise TrainerError(f"{file}: saved with expert_parallel={state['layout'].get('ep', 1)}"
                               f", running with {self.layout.ep_size}")
        self.model.load_state_dict(state["model"])
        self._opt.load(state["optimizer"], Path(path), self.layout)
        self._opt_step = int(state["schedule"]["opt_step"])
        self._base_lr = float(state["schedule"]["base_lr"])
        self.reference = None
        if "reference" in state:  # a KL run past its first RL update: the same reference
            self.reference = self._frozen_copy()
            self.reference.load_state_dict(state["reference"])

    def set_lr(self, lr: float) -> None:
        """Base learning rate from the next optimizer step on (warmup/schedule multiply it)."""
        self._base_lr = float(lr)

    @property
    def optimizer_step(self) -> int:
        """Optimizer steps taken so far (restored by `load_state`)."""
        return self._opt_step

    def close(self) -> None:
        """Release megatron's process groups (and torch.distributed)."""
        mmodel.destroy_parallel()


# --------------------------------------------------------------------------------- helpers
def use_megatron_optimizer() -> bool:
    """megatron's DDP and optimizers when CUDA is there; they hard-code it. (CPU tests run them
    under `cpu_compat.cuda_as_cpu()` by patching this to True.)"""
    return torch.cuda.is_available()


def _hf_source(model: Any) -> tuple[Any, Any, str]:
    """(HF config, tensor getter by HF name or None, dtype name) from a HF model, directory or
    config."""
    from transformers import PretrainedConfig

    def dtype_of(cfg: Any) -> str:
        raw = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
        name = str(raw).removeprefix("torch.")
        return name if name in mmodel.DTYPES else "float32"

    if isinstance(model, PretrainedConfig):
        return model, None, dtype_of(model)
    if isinstance(model, (str, Path)):
        from transformers import AutoConfig

        from asyncrl.trainer.megatron.hf_files import HFReader

        cfg = AutoConfig.from_pretrained(str(model))
        return cfg, HFReader(model), dtype_of(cfg)
    state = model.state_dict()

    def get(name: str) -> torch.Tensor:
        t = convert.from_fused(state, name)
        if t is None:
            raise TrainerError(f"HF model has no parameter {name!r}")
        return t

    return model.config, get, str(next(model.parameters()).dtype).removeprefix("torch.")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

