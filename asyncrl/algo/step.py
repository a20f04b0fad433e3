"""One RL step, one SFT step and one SFT evaluation, written once for every trainer.

Owns: the order of work inside a step and the metrics it reports. RL (`rl_step`): flatten the
batch, split it into `algorithm.optimizer_steps_per_rl_step` mini-batches, recompute the old
(proximal) log-probs of every micro-batch under the current weights (with the trainer/sampler
mismatch metrics; with one mini-batch they come from the training forward itself) and, with
`algorithm.kl_coef`, under the frozen reference policy, then per mini-batch accumulate
`grpo_loss` with its off-policy correction (plus the weighted `kl_penalty`) over the
micro-batches and take one optimizer step. SFT (`sft_step`, `sft_eval`): the masked
cross-entropy, token-mean over all examples, with and without one optimizer step. A step
given `give_up` asks it before each micro-batch's forward and backward until its first
optimizer step: true, and it drops its gradients and raises `StepAbandoned` (a stop that
cannot wait for the step's end).

Does not own: the model, optimizer, parallelism or checkpoint I/O (the trainer, behind
`StepBackend`), the loss math (`loss`, `offpolicy`), sequences, sharding and packing
(`batching`) or the lr schedule (`schedule`, applied by the backend's optimizer step).

Normalisation, for every trainer alike: the loss of a micro-batch is its token sum divided by
the trained tokens of the whole mini-batch over all ranks, multiplied by the data-parallel
size (gradients are averaged over replicas), so an update equals the single-process update on
the whole batch up to float summation order, whatever the packing or the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from asyncrl.algo import batching, offpolicy
from asyncrl.algo.batching import Packed, TrainSeq
from asyncrl.algo.loss import StepStats, grpo_loss, kl_penalty, sft_loss
from asyncrl.config import AlgorithmSection
from asyncrl.errors import StepAbandoned
from asyncrl.log import get_logger
from asyncrl.records import Batch

log = get_logger(__name__)

Tensors = dict[str, torch.Tensor]
SftExamples = list[tuple[list[int], list[int]]]
GiveUp = Callable[[], bool] | None
"""Asked before each micro-batch of a step until its first optimizer step (`StopRequest.overdue`)."""


class StepBackend(Protocol):
    """What a trainer lends the shared steps: only what differs between trainers.

    Every rank of a run calls the steps with the same arguments; a backend's collectives (in
    `accumulate`, `apply_gradients`, `reduce_metrics`) are matched because every rank plans the
    same number of micro-batches.
    """

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas whose gradients the optimizer averages (1 on one process).
        Each micro-batch loss is multiplied by it, turning that average into the sum."""
        ...

    @property
    def optimizer_step(self) -> int:
        """Optimizer steps taken so far (`apply_gradients` counts them)."""
        ...

    def plan(self, seqs: Sequence[TrainSeq]) -> list[Packed]:
        """This rank's micro-batches for one mini-batch (its data-parallel share, packed under
        the token budget), padded with `batching.dummy` to the count of the busiest rank so
        that every rank makes the same number of forward/backward calls. Never empty."""
        ...

    def tensors(self, mb: Packed) -> Tensors:
        """`mb` as `[B, T]` tensors on the model's device: `input_ids` (long), `mask`,
        `advantages`, `sampling_logprobs` (float32) and `lag` (long). Padding has mask 0."""
        ...

    def logprobs(self, t: Tensors, temperature: float) -> torch.Tensor:
        """Log-prob of token i given tokens < i under `logits / temperature`, `[B, T]` float32,
        0 at position 0; differentiable (the forward pass of the model on `t`). The steps read
        it only where `t["mask"]` is 1: a backend may skip the other positions (the torch
        trainer computes no logits there and returns 0)."""
        ...

    def logprobs_and_entropy(self, t: Tensors, temperature: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` and the entropy of the same tempered distribution (a metric, no
        gradient, read where the mask is 1 like the log-probs), from one pass over the logits."""
        ...

    def reference_logprobs(self, t: Tensors, temperature: float) -> torch.Tensor:
        """`logprobs` under the reference policy, without gradient: the weights as they were
        at the backend's first call of this method (a frozen copy the backend keeps, saves and
        restores with its state). Called only when `algorithm.kl_coef` > 0."""
        ...

    def accumulate(self, index: int, count: int) -> AbstractContextManager[Any]:
        """Entered around the forward and backward of micro-batch `index` of the `count` that
        feed one optimizer step: where gradients are cleared before the first or kept local
        (no all-reduce) until the last."""
        ...

    def apply_gradients(self, lr_scale: float) -> tuple[float, float]:
        """Clip to `algorithm.grad_clip`, step at the scheduled lr times `lr_scale`, zero the
        gradients and count the step. Returns (global gradient norm before clipping, over all
        ranks; the lr used)."""
        ...

    def discard_gradients(self) -> None:
        """Drop the gradients accumulated so far (an abandoned step): the weights and the
        optimizer state stay those of the last optimizer step."""
        ...

    def reduce_metrics(self, stats: StepStats, prefix: str) -> dict[str, float]:
        """`stats` summed over every rank (extremes: max/min), as `StepStats.means(prefix)`;
        ranks holding copies of the same data (tensor parallel) count once."""
        ...

    def gather_replicas(self, x: torch.Tensor) -> torch.Tensor:
        """1-D `x` (a value per trained token: lengths differ) of every data-parallel replica,
        concatenated; `x` itself on one process. Every rank calls it; ranks holding copies of
        the same data (tensor parallel) contribute one copy."""
        ...


def _check_give_up(backend: StepBackend, give_up: GiveUp) -> None:
    if give_up is not None and give_up():
        backend.discard_gradients()
        raise StepAbandoned()


def rl_step(backend: StepBackend, batch: Batch, algo: AlgorithmSection, *,
            temperature: float, lr_scale: float = 1.0,
            give_up: GiveUp = None) -> dict[str, float]:
    """One RL step on the kept rollouts of `batch` (see `asyncrl.trainer.base.Trainer`).

    `temperature` is the rollouts' sampling temperature; `lr_scale` multiplies the scheduled
    lr. Returns `train/…` metrics: the means of `grpo_loss`'s and the correction's metrics,
    mismatch metrics and ratio quantiles, entropy, gradient norms, lr and counts.
    """
    seqs = batching.sequences_from_batch(batch)
    if not seqs:
        log.warning("train_step_empty", step=batch.step)
        return {"train/sequences": 0.0, "train/optimizer_steps": 0.0}
    minis = batching.split_minibatches(seqs, algo.optimizer_steps_per_rl_step)
    plans = [backend.plan(mini) for mini in minis]
    stats = StepStats()
    quant = offpolicy.RatioQuantiles()
    olds, refs = _old_and_reference_logprobs(backend, plans, algo, temperature, stats, quant,
                                             give_up)

    norms: list[float] = []
    lr = 0.0
    for mini, plan, old_plan, ref_plan in zip(minis, plans, olds, refs, strict=True):
        normalizer = float(sum(s.num_loss_tokens for s in mini))
        for i, (mb, old, ref) in enumerate(zip(plan, old_plan, ref_plan, strict=True)):
            ask = None if norms else give_up  # past the first optimizer step: finish
            _check_give_up(backend, ask)
            _train_micro_batch(backend, mb, i, len(plan), old, ref, algo, normalizer,
                               temperature, stats, quant, ask)
        norm, lr = backend.apply_gradients(lr_scale)
        norms.append(norm)

    out = backend.reduce_metrics(stats, "train/")
    out["train/loss"] = out.get("train/pg_loss", 0.0)
    out.update(quant.metrics("train/", backend.gather_replicas))
    out.update({
        "train/grad_norm": sum(norms) / len(norms),
        "train/grad_norm_max": max(norms),
        "train/lr": lr,
        "train/sequences": float(len(seqs)),
        "train/mini_batches": float(len(minis)),
        "train/micro_batches": float(sum(len(p) for p in plans)),
        "train/optimizer_step": float(backend.optimizer_step),
    })
    return out


def _old_and_reference_logprobs(
        backend: StepBackend, plans: list[list[Packed]], algo: AlgorithmSection,
        temperature: float, stats: StepStats, quant: offpolicy.RatioQuantiles,
        give_up: GiveUp = None,
) -> tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor | None]]]:
    """Per micro-batch of every plan: its old (proximal) log-probs under the weights that will
    be updated, and its reference log-probs (with `algorithm.kl_coef`); None where not computed
    here. The engine's (behaviour) logprobs feed the mismatch metrics and
    `algorithm.correction`. With one mini-batch the weights do not move before its only
    optimizer step, so each micro-batch's training forward gives its old logprobs too
    (detached): no separate pass, and None here (TRL's `num_iterations = 1` does the same).
    With several, they are computed first, here."""
    fused = len(plans) == 1
    olds: list[list[torch.Tensor | None]] = []
    refs: list[list[torch.Tensor | None]] = []
    kl = algo.kl_coef > 0
    with torch.no_grad():
        for plan in plans:
            olds.append([])
            refs.append([])
            for mb in plan:
                if kl or not fused:
                    _check_give_up(backend, give_up)
                t = backend.tensors(mb) if kl or not fused else {}
                refs[-1].append(backend.reference_logprobs(t, temperature) if kl else None)
                old = None if fused else backend.logprobs(t, temperature)
                if old is not None:
                    _mismatch(stats, quant, old, t)
                olds[-1].append(old)
    return olds, refs


def _train_micro_batch(backend: StepBackend, mb: Packed, index: int, count: int,
                       old: torch.Tensor | None, ref: torch.Tensor | None,
                       algo: AlgorithmSection, normalizer: float, temperature: float,
                       stats: StepStats, quant: offpolicy.RatioQuantiles,
                       give_up: GiveUp = None) -> None:
    """Forward and backward of micro-batch `index` of the `count` feeding one optimizer step:
    the corrected `grpo_loss` over `normalizer` trained tokens, plus the weighted `kl_penalty`
    against `ref` when given; its metrics go into `stats`. `old` None: the old log-probs are
    this forward's, detached (one mini-batch). `give_up` is asked again before the backward."""
    t = backend.tensors(mb)
    with backend.accumulate(index, count):
        lp, ent = backend.logprobs_and_entropy(t, temperature)
        if old is None:
            old = lp.detach()
            _mismatch(stats, quant, old, t)
        coef, cm = offpolicy.correction_for(algo, old, t["sampling_logprobs"], t["mask"])
        loss, m = grpo_loss(lp, old, t["advantages"], t["mask"], algo.eps_low, algo.eps_high,
                            algo.dual_clip, normalizer=normalizer, coef=coef)
        if ref is not None:
            kl_loss, km = kl_penalty(lp, ref, t["mask"], algo.kl_estimator,
                                     normalizer=normalizer)
            loss = loss + algo.kl_coef * kl_loss
            stats.add(km)
        _check_give_up(backend, give_up)
        (loss * backend.dp_size).backward()
    stats.add(m)
    stats.add(cm)
    stats.add({"entropy_sum": (ent * t["mask"]).sum()})


def _mismatch(stats: StepStats, quant: offpolicy.RatioQuantiles, old: torch.Tensor,
              t: Tensors) -> None:
    """The trainer/sampler mismatch of one micro-batch, into the step's sums and quantiles."""
    stats.add(offpolicy.mismatch_stats(old, t["sampling_logprobs"], t["mask"], t["lag"]))
    quant.add(old, t["sampling_logprobs"], t["mask"])


def sft_step(backend: StepBackend, examples: SftExamples,
             give_up: GiveUp = None) -> dict[str, float]:
    """One optimizer step of masked cross-entropy on (token ids, loss mask) pairs, token-mean
    over all examples (logits at temperature 1). Returns `sft/loss`, `sft/tokens`,
    `sft/grad_norm`, `sft/lr`, `sft/examples` and `sft/optimizer_step`."""
    seqs = batching.sequences_from_sft(examples)
    plan = backend.plan(seqs)
    normalizer = float(max(1, sum(s.num_loss_tokens for s in seqs)))
    stats = StepStats()
    for i, mb in enumerate(plan):
        _check_give_up(backend, give_up)
        t = backend.tensors(mb)
        with backend.accumulate(i, len(plan)):
            loss, m = sft_loss(backend.logprobs(t, 1.0), t["mask"], normalizer=normalizer)
            _check_give_up(backend, give_up)  # before the backward: two thirds of the work
            (loss * backend.dp_size).backward()
        stats.add(m)
    norm, lr = backend.apply_gradients(1.0)
    out = backend.reduce_metrics(stats, "sft/")
    out["sft/loss"] = out.pop("sft/nll", 0.0)
    out.update({"sft/grad_norm": norm, "sft/lr": lr, "sft/examples": float(len(seqs)),
                "sft/optimizer_step": float(backend.optimizer_step)})
    return out


def sft_eval(backend: StepBackend, examples: SftExamples) -> dict[str, float]:
    """Masked cross-entropy of `examples` under the current weights, without an update (a
    held-out loss): `sft/loss` (token mean) and `sft/tokens`."""
    seqs = batching.sequences_from_sft(examples)
    stats = StepStats()
    with torch.no_grad():
        for mb in backend.plan(seqs):
            t = backend.tensors(mb)
            stats.add(sft_loss(backend.logprobs(t, 1.0), t["mask"])[1])
    out = backend.reduce_metrics(stats, "sft/")
    out["sft/loss"] = out.pop("sft/nll", 0.0)
    return out
