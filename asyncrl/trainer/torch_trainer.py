"""The torch trainer: an HF causal LM trained with plain torch on CPU, one GPU, or data-parallel
(DDP / FSDP2) under torchrun.

Owns: the model's device placement and parallel wrapper, the AdamW optimizer and its
schedule, how a micro-batch becomes tensors, weight export and trainer state. Its log-probs
come from `asyncrl.trainer.lm_head`: the LM head runs only at the positions that predict a
trained token (`trainer.full_logits` restores logits at every position). The
RL and SFT steps themselves are `asyncrl.algo.step`'s, shared with the megatron trainer: this
trainer is their `StepBackend`. Does not own: the steps, the loss, packing or metric
definitions (`asyncrl.algo`), RoC, checkpoint layout (`asyncrl.checkpoint`) or the loop.

Data parallel: every rank calls `train_step` with the same `Batch`. Each mini-batch is sharded
over ranks by `algo.batching.shard` (balanced by tokens, computed identically everywhere), each
rank packs its share, and ranks with fewer micro-batches run one-token dummies so that every
rank makes the same number of forward/backward calls (DDP and FSDP2 collectives stay matched).
Every rank is a replica (`dp_size` = world size); see `algo.step` for the loss normalisation.

LoRA (`trainer.lora`; the adapter-specific methods are `asyncrl.trainer.lora.LoraFace`, which
this trainer mixes in): the model's targeted linear layers become PEFT LoRA layers, the base is
frozen and the optimizer holds only the adapters, from construction (`apply_to = "all"`) or
from the first RL update (`"rl"`: SFT steps before it train every parameter). Weight sync then moves only the adapter (`AdapterTrainer` in `base.py`), and the
base once whenever it changed; checkpoints hold the adapter, its optimizer state, and the base
only when this run trained it. LoRA runs in one process (no DDP/FSDP2).

Memory: after each SFT and RL step, checkpoint and export the C heap's free pages are handed
back (`asyncrl.allocator.release`), so the process holds what is live between phases rather
than the high-water mark of every thread's arena.

Dropout should be 0 (the default of the HF configs used): the old logprobs are recomputed in
train mode, and the ratio is only 1 at the first step when both passes see the same network.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl import allocator
from asyncrl.algo import batching, offpolicy, step
from asyncrl.algo.batching import Packed, TrainSeq
from asyncrl.algo.loss import StepStats
from asyncrl.algo.schedule import lr_factor
from asyncrl.algo.step import GiveUp
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.errors import StepAbandoned, TrainerError
from asyncrl.log import get_logger
from asyncrl.modeling import moe_shape, routing_replay
from asyncrl.records import Batch
from asyncrl.trainer import lm_head, moe_replay, shared_prefix
from asyncrl.trainer.lora import LoraFace

log = get_logger(__name__)

SHARED_MIN_TOKENS = 16
"""The shortest common prefix worth laying out once (`trainer.share_prefixes`)."""

STATE_FILE = "trainer.pt"


class TorchTrainer(LoraFace):
    """Implements `asyncrl.trainer.base.Trainer` for an HF `PreTrainedModel`, and
    `asyncrl.algo.step.StepBackend` for the shared steps.

    `temperature` is the sampling temperature of the rollouts (logprobs are computed on
    `logits / temperature`, matching the engine's). `total_steps` is the number of optimizer
    steps of the run, needed only by the cosine schedule. `seed` (`run.seed`) seeds the LoRA
    adapter's initial A factors (`lora.attach`).
    """

    def __init__(self, model: Any, cfg: TorchTrainerConfig, algo: AlgorithmSection,
                 pad_token_id: int, *, temperature: float = 1.0,
                 total_steps: int | None = None, seed: int = 0) -> None:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg, self.algo = cfg, algo
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self._split_head = not cfg.full_logits
        """Logits only where a trained token is predicted (`asyncrl.trainer.lm_head`)."""
        self._windows = _sharing(model.config, cfg)
        """The attention windows per layer type (`shared_prefix.windows`); None: no sharing."""
        self._share = SHARED_MIN_TOKENS if self._windows is not None else 0
        """Shared prefixes of at least this many tokens are computed once (0: off)."""
        self._pair_cost = shared_prefix.pair_cost(model.config) if self._share else 0.0
        self.total_steps = total_steps
        self.seed = seed
        if algo.lr_schedule == "cosine" and not total_steps:
            raise TrainerError("algorithm.lr_schedule = cosine needs total_steps")
        self.world_size, self.rank = _init_distributed(cfg)
        self.device = _device(cfg.device)
        self._tuner: Any = None  # ThreadTuner (.threads) of the SFT steps, made at the first
        if self.world_size > 1 and cfg.parallel == "none":
            raise TrainerError(f"trainer.parallel is 'none' but the world size is "
                               f"{self.world_size}; use 'ddp' or 'fsdp2' under torchrun")

        model.to(self.device)
        model.config.use_cache = False
        if cfg.gradient_checkpointing:
            # transformers 5 renamed it (the old name warns); 4.x only has the old name.
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
        self.model = model
        self._module: Any = model
        self._init_lora(cfg.lora)
        if cfg.lora is not None and self.world_size > 1:
            raise TrainerError("trainer.lora runs in one process; set trainer.parallel = "
                               "'none' and launch without torchrun")
        if algo.kl_coef > 0 and self.world_size > 1 and cfg.parallel == "fsdp2":
            raise TrainerError("algorithm.kl_coef needs a frozen copy of the model, which "
                               "trainer.parallel = 'fsdp2' does not keep yet; use 'ddp'")
        if self.world_size > 1:
            self._module = self._wrap(model)
        self._base_lr = algo.lr
        moe = moe_shape(model.config)  # routing_replay refuses `true` on a dense model
        on = routing_replay(algo.routing_replay, model.config)
        self.replay = moe_replay.Replay(*moe[:2]) if on and moe else None
        """Routing replay (`algorithm.routing_replay`, `asyncrl.trainer.moe_replay`)."""
        self._opt_step = 0
        self.reference: Any = None
        """Frozen copy of the policy at the first RL update, when `algorithm.kl_coef` > 0."""
        self.optimizer = self._new_optimizer()
        if cfg.lora is not None and cfg.lora.apply_to == "all":
            self.attach_lora()
        log.info("trainer_ready", kind="torch", device=str(self.device),
                 world_size=self.world_size, parallel=cfg.parallel,
                 params=sum(p.numel() for p in model.parameters()))

    def _new_optimizer(self) -> torch.optim.Optimizer:
        a = self.algo
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                 lr=a.lr, betas=(a.betas[0], a.betas[1]),
                                 weight_decay=a.weight_decay)

    # ------------------------------------------------------------------ parallel wrappers
    def _wrap(self, model: Any) -> Any:
        if self.cfg.parallel == "ddp":
            import inspect

            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # Buffers (rotary tables) are identical everywhere: no per-forward broadcast.
            key = "forward_sync_buffers" if "forward_sync_buffers" in \
                inspect.signature(DDP).parameters else "broadcast_buffers"
            opts: dict[str, Any] = {key: False}
            return DDP(model, device_ids=ids, **opts)
        from torch.distributed.fsdp import fully_shard

        # Sharding assumes identical weights everywhere; make it so.
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        blocks = set(getattr(model, "_no_split_modules", None) or [])
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m)
        fully_shard(model)
        return model

    @property
    def _fsdp(self) -> bool:
        return self.world_size > 1 and self.cfg.parallel == "fsdp2"

    # ------------------------------------------------- step hooks (`algo.step.StepBackend`)
    @property
    def dp_size(self) -> int:
        """Every rank is a data-parallel replica (DDP and FSDP2 both average gradients)."""
        return self.world_size

    def accumulate(self, index: int, count: int) -> contextlib.AbstractContextManager[Any]:
        """DDP keeps gradients local until the last micro-batch of an optimizer step; FSDP2
        reduces every backward (its sharded gradients cannot wait)."""
        if self.world_size > 1 and self.cfg.parallel == "ddp" and index < count - 1:
            return self._module.no_sync()
        return contextlib.nullcontext()

    def plan(self, seqs: Sequence[TrainSeq]) -> list[Packed]:
        """This rank's micro-batches for one mini-batch, padded with dummies to the count of
        the busiest rank (every rank computes every rank's packing; no collective needed)."""
        budget = self.cfg.micro_batch_tokens
        lengths = [s.num_tokens for s in seqs]
        counts, mine = [], []
        for r in range(self.world_size):
            share = [seqs[i] for i in batching.shard(lengths, r, self.world_size)]
            packed = batching.pack(share, budget, share=self._share, pair_cost=self._pair_cost)
            counts.append(len(packed))
            if r == self.rank:
                mine = packed
        n = max(1, *counts)
        return mine + [batching.dummy(self.pad_token_id)] * (n - len(mine))

    def tensors(self, mb: Packed) -> dict[str, torch.Tensor]:
        """A micro-batch as `[B, T]` tensors: one row per sequence, right-padded.

        Rows rather than one packed row: with position-id packing the model needs a
        block-diagonal mask, which runs on the slow masked attention path and costs
        O(total_tokens^2); right-padded rows keep the plain causal kernel (a valid token never
        attends to the padding after it) at O(sum of length^2). Padding has mask 0.

        When `mb.shared_prefix` marks runs of sequences with a common prefix, the model runs
        instead on `shared_prefix.layout`'s rows (`pack_*`: each run once, its prefix once,
        under a masked kernel): the `[B, T]` tensors stay the layout of the loss.
        """
        rows: list[tuple[int, int]] = []
        start = 0
        owner = mb.seq_index
        for i in range(1, len(owner) + 1):
            if i == len(owner) or owner[i] != owner[start]:
                rows.append((start, i))
                start = i
        width = max(e - s for s, e in rows)

        def grid(values: list, pad: float | int) -> list[list]:
            return [values[s:e] + [pad] * (width - (e - s)) for s, e in rows]

        dev = self.device
        shared = {}
        if mb.shared_prefix:  # some sequences share a prefix: the model runs on the layout
            shared = shared_prefix.layout([mb.input_ids[s:e] for s, e in rows], mb.shared_prefix,
                                          self.pad_token_id, width, dev, self.model.dtype,
                                          self._windows)
        if self.replay is not None and mb.routed_experts:
            shared["routes"] = moe_replay.routes(
                mb.routed_experts, [e - s for s, e in rows], width, mb.shared_prefix,
                self.replay.layers, self.replay.top_k, dev)
        return shared | {
            "input_ids": torch.tensor(grid(mb.input_ids, self.pad_token_id), dtype=torch.long,
                                      device=dev),
            "position_ids": torch.arange(width, device=dev).expand(len(rows), width),
            "mask": torch.tensor(grid(mb.loss_mask, 0), dtype=torch.float32, device=dev),
            "advantages": torch.tensor(grid(mb.advantages, 0.0), dtype=torch.float32,
                                       device=dev),
            "sampling_logprobs": torch.tensor(grid(mb.sampling_logprobs, 0.0),
                                              dtype=torch.float32, device=dev),
            "lag": torch.tensor(grid(mb.lags or [0] * len(owner), 0), dtype=torch.long,
                                device=dev),
        }

    def _logprobs(self, module: Any, model: Any, t: dict[str, torch.Tensor],
                  temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`lm_head.logprobs`: the LM head at the trained positions only, unless
        `trainer.full_logits` is set or the model's forward turned out not to call its output
        embedding (then the full path from then on, said once in the log)."""
        replay = self.replay.routing(model, t.get("routes")) if self.replay is not None \
            else contextlib.nullcontext()
        with replay:
            lp, ent, split = lm_head.logprobs(module, model, t, temperature, entropy=entropy,
                                              split=self._split_head)
        if self._split_head and not split:
            self._split_head = False
            log.warning("lm_head_not_split", model=type(model).__name__,
                        reason="the forward never called its output embedding")
        return lp, ent

    def logprobs(self, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """`StepBackend.logprobs`; 0 where the mask is 0 unless `trainer.full_logits`."""
        return self._logprobs(self._module, self.model, t, temperature, entropy=False)[0]

    def logprobs_and_entropy(self, t: dict[str, torch.Tensor], temperature: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._logprobs(self._module, self.model, t, temperature, entropy=True)

    def reference_logprobs(self, t: dict[str, torch.Tensor], temperature: float
                           ) -> torch.Tensor:
        """Log-probs under the frozen reference (`algorithm.kl_coef`): a copy of the model
        taken at the first call, before that step's update (see `StepBackend`)."""
        if self.reference is None:
            self.reference = self._frozen_copy()
        with torch.no_grad():
            return self._logprobs(self.reference, self.reference, t, temperature,
                                  entropy=False)[0]

    def _frozen_copy(self) -> Any:
        """The trained model as it is now (with a LoRA adapter, base and adapter), as a separate
        module without gradients."""
        import copy

        ref = copy.deepcopy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def apply_gradients(self, lr_scale: float) -> tuple[float, float]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.algo.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        lr = self._base_lr * lr_scale * lr_factor(self._opt_step, self.algo.warmup_steps,
                                                  self.algo.lr_schedule, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._opt_step += 1
        if self.peft is None:
            self._base_trained = self.base_changed = True
        return float(norm), lr

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reduce_metrics(self, stats: StepStats, prefix: str) -> dict[str, float]:
        stats.reduce(self.device)
        return stats.means(prefix)

    def gather_replicas(self, x: torch.Tensor) -> torch.Tensor:
        return offpolicy.gather_1d(x, self.device)

    # ----------------------------------------------------------------------------- steps
    def train_step(self, batch: Batch, lr_scale: float = 1.0,
                   give_up: GiveUp = None) -> dict[str, float]:
        """One RL step (see `base.Trainer`, `algo.step.rl_step`). Blocking."""
        self.attach_lora()  # lora.apply_to = "rl": the adapter starts at the first RL update
        try:
            out = step.rl_step(self, batch, self.algo, temperature=self.temperature,
                               lr_scale=lr_scale, give_up=self._own(give_up))
        finally:
            allocator.release()  # the step's activations and gradients (`asyncrl.allocator`)
        if self.replay is not None:
            out.update(self.replay.metrics("train/"))
        return out

    def _own(self, give_up: GiveUp) -> GiveUp:
        """`give_up` on one process; None under torchrun, where every rank must take the same
        micro-batches (a rank that gave up alone would leave the others in a collective)."""
        return give_up if self.world_size == 1 else None

    def sft_step(self, examples: list[tuple[list[int], list[int]]],
                 give_up: GiveUp = None) -> dict[str, float]:
        """One optimizer step of masked cross-entropy, token-mean over all examples. On a CPU
        with `threads = 0`, the thread count of each step is chosen by timing the steps per
        token (`asyncrl.trainer.threads.ThreadTuner`: all of torch's threads on an idle
        machine, fewer when other programs want the cores); each change is logged (`torch_threads`)."""
        give_up = self._own(give_up)
        if self.cfg.threads or self.device.type != "cpu" or self.world_size > 1:
            try:
                return step.sft_step(self, examples, give_up)
            finally:
                allocator.release()  # the step's activations and gradients
                # (`asyncrl.allocator`)
        if self._tuner is None:
            from asyncrl.trainer.threads import ThreadTuner

            self._tuner = ThreadTuner(most=torch.get_num_threads())
        n, was = self._tuner.threads(), self._tuner.current
        torch.set_num_threads(n)  # this thread's OpenMP team (the engine's is its own)
        t0 = time.perf_counter()
        try:
            out = step.sft_step(self, examples, give_up)
        except StepAbandoned:
            allocator.release()
            raise  # a part of a step says nothing of its thread count's speed
        finally:
            # torch also keeps the count as the one a new thread starts with (the engine's,
            # the first time it computes): leave it at the default between steps
            torch.set_num_threads(self._tuner.most)
        took = time.perf_counter() - t0
        allocator.release()  # after the timing: trimming is not the step's cost
        # per token: a step of long transcripts is no slower a thread count than one of short
        # ones (SFT steps of 8 real-model transcripts vary 2x in length)
        self._tuner.record(n, took / max(1, sum(len(ids) for ids, _ in examples)))
        if self._tuner.current != was:
            log.info("torch_threads", threads=self._tuner.current, was=was,
                     seconds_per_step=round(took, 3))
        return out

    def sft_eval(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """Masked cross-entropy of `examples` under the current weights, without an update
        (a held-out loss): `sft/loss` (token mean) and `sft/tokens`."""
        return step.sft_eval(self, examples)

    # ---------------------------------------------------------------------- weights/state
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full: dict[str, Any] = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return full
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full weights by HF name. Without FSDP these are views of the live parameters (copy
        them if they must outlive the next step); with FSDP2 a CPU copy on rank 0 and an empty
        dict elsewhere (every rank must call it). With LoRA, new tensors with the adapter
        merged in."""
        if self.peft is not None:
            return self._merged_state_dict()
        return self._full_state_dict()

    def export_hf(self, path: str | Path) -> None:
        """Write an HF model directory (safetensors + config) at `path` from rank 0.

        With LoRA attached, `path` holds the adapter (a PEFT directory), `path/base/` the base
        model when this run trained it (an SFT stage before `apply_to = "rl"`), and
        `path/merged/` the merged HF model when `lora.merge_on_export` is set."""
        if self.peft is not None:
            self._export_lora(path)
            return
        sd = self._full_state_dict()
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out, state_dict=sd if self._fsdp else None,
                                       safe_serialization=True)
        allocator.release()  # the serialisation buffers
        _barrier()

    def save_state(self, path: str | Path) -> None:
        """Model, optimizer and schedule state into directory `path` (rank 0 writes). With
        LoRA attached: the adapter and its optimizer state, plus the base weights only when
        this run trained them (otherwise the base is what the run starts from anyway)."""
        if self.peft is not None:
            lora_state = self._lora_state()
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(lora_state, out / STATE_FILE)
            return
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        else:
            msd, osd = self.model.state_dict(), self.optimizer.state_dict()
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            state: dict[str, Any] = {"model": msd, "optimizer": osd,
                     "schedule": {"opt_step": self._opt_step, "base_lr": self._base_lr},
                     "lora": {"attached": False, "base_trained": self._base_trained}}
            if self.reference is not None:
                state["reference"] = self.reference.state_dict()
            torch.save(state, out / STATE_FILE)
        allocator.release()  # the serialisation buffers
        _barrier()

    def load_state(self, path: str | Path) -> None:
        """Restore what `save_state` wrote (every rank reads the file)."""
        file = Path(path) / STATE_FILE
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as e:
            raise TrainerError(f"cannot read trainer state {file}: {e}") from e
        self.base_changed = True  # the engines hold what they were built with
        lora_state = state.get("lora", {"attached": False, "base_trained": False})
        if lora_state["attached"]:
            self._load_lora_state(state)
        elif self._fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"],
                           options=StateDictOptions(full_state_dict=True))
        else:
            if self.peft is not None:
                raise TrainerError(f"{file} is a full-parameter state, but the trainer's LoRA "
                                   f"adapter is already attached (lora.apply_to = 'all')")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self._base_trained = bool(lora_state["base_trained"])
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


# ------------------------------------------------------------------------------- helpers
def _sharing(config: Any, cfg: TorchTrainerConfig) -> dict[str, int | None] | None:
    """`shared_prefix.windows` of the model when `trainer.share_prefixes` can apply to it, else
    None (said in the log when it was asked for): it needs the split head, an attention
    implementation that takes an additive 4-D mask, and attention such a mask expresses."""
    if not cfg.share_prefixes or cfg.full_logits:
        return None
    attention = getattr(config, "_attn_implementation", None)
    if attention not in shared_prefix.ATTENTION:
        log.info("shared_prefixes_off", attention=attention,
                 reason=f"needs attention in {shared_prefix.ATTENTION}")
        return None
    try:
        return shared_prefix.windows(config)
    except TrainerError as e:
        log.warning("shared_prefixes_off", attention=attention, reason=str(e))
        return None


def _init_distributed(cfg: TorchTrainerConfig) -> tuple[int, int]:
    """(world size, rank); joins torchrun's process group when launched under it."""
    if not dist.is_available():
        return 1, 0
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return 1, 0
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return dist.get_world_size(), dist.get_rank()


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def iter_params(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Named parameters as plain tensors (DTensors gathered), for tests and exports."""
    for name, p in model.named_parameters():
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
