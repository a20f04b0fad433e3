"""Curriculum stage rules, as pure functions and a small state machine.

Owns: when a stage ends (its step count, or a plateau of the watched eval metric), which
problems a stage trains on (its `source_weights` mix; in a `hard` stage those the current
policy does not solve k/k), and the response budget, eval temperature and rollout settings in
force (a stage's learning rate is `asyncrl.algo.schedule.stage_lr`); `TrainState`, where a run
is in its curriculum (the part of a checkpoint besides weights and optimizer). Does not own:
running rollouts or evaluations (the train loop feeds results in).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncrl.config import PlateauRule, RolloutSection, RunConfig, StageSection
from asyncrl.formats import ToolFormat
from asyncrl.records import Problem
from asyncrl.rollout.agent import RolloutSettings
from asyncrl.tasks.stream import source_mix


class PlateauState(msgspec.Struct, kw_only=True):
    """Progress of a plateau rule: best value seen and evaluations since it improved."""

    best: float | None = None
    since_best: int = 0


class TrainState(msgspec.Struct, kw_only=True):
    """Everything besides weights and optimizer that a resumed run needs."""

    stage_index: int = 0
    stage_step: int = 0
    global_step: int = 0
    policy_version: int = 0
    plateau: PlateauState = msgspec.field(default_factory=PlateauState)
    data_cursor: dict[str, Any] = {}
    sft_cursor: dict[str, Any] = {}
    """Where a chat-file SFT stage is in its epochs (`asyncrl.sft.stage.SFTPlan.cursor`), or a
    distill stage in its rounds (`{"round": r}`: round r sampled, `asyncrl.sft.distill`)."""
    sft_loss_window: list[float] = []
    """An SFT stage's loss over the steps since its last `sft_step` row: [sum of loss x
    tokens, tokens, steps] (`asyncrl.sft.stage.step_row`); empty when none."""
    stage_problem_ids: list[str] | None = None
    """The hard-filtered problem ids of the current stage (None = all)."""
    rng_state: Any = None
    metrics_rows: int = 0
    """Rows in `metrics.jsonl` when the checkpoint was written: a resumed run marks the rows
    after them as replaced (`asyncrl.observe.report.load_metrics`)."""
    pending_problem_ids: list[str] = []
    """Problems of rollout waves under way at the checkpoint (their refills too; at
    `max_staleness = 0` the next step's wave): a resumed run regenerates them first, in
    order, under the restored weights."""
    eval_due: bool = False
    """A stop aborted the evaluation that follows the current step (an RL step's, or an SFT
    stage's after its steps and weight sync): a resumed run runs it before anything else."""


def as_rng_state(s: Any) -> tuple:
    """`TrainState.rng_state` (a `random.Random` state, its tuples made lists by JSON) as
    `Random.setstate` takes it."""
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def plateau_update(rule: PlateauRule, state: PlateauState, metrics: Mapping[str, float]
                   ) -> tuple[PlateauState, bool]:
    """Feed one evaluation; returns the new state and whether the stage has plateaued.

    An evaluation without the watched metric changes nothing. Improvement means exceeding the
    best by more than `min_delta`; `patience` evaluations in a row without one is a plateau.
    """
    value = metrics.get(rule.metric)
    if value is None:
        return state, False
    if state.best is None or value > state.best + rule.min_delta:
        return PlateauState(best=value, since_best=0), False
    new = PlateauState(best=state.best, since_best=state.since_best + 1)
    return new, new.since_best >= rule.patience


def stage_done(stage: StageSection, steps_done: int, plateaued: bool) -> bool:
    """A stage ends at its step count, or earlier on a plateau when it has a rule."""
    return steps_done >= stage.steps or (stage.plateau is not None and plateaued)


def hard_problem_ids(correct_counts: Mapping[str, int], k: int) -> set[str]:
    """Problems not solved every time (fewer than k of k samples correct)."""
    return {pid for pid, c in correct_counts.items() if c < k}


def check_source_weights(stages: Sequence[StageSection], problems: Sequence[Problem],
                         seed: int) -> None:
    """Each stage's `source_weights` names sources of the training `problems`: a key that names
    none is a `ConfigError` naming `stages[i].source_weights` (and listing the sources there
    are), raised when the problems are read, before a model is built."""
    for i, st in enumerate(stages):
        if st.source_weights:
            source_mix(problems, st.source_weights, seed=seed, stage=i,
                       key=f"stages[{i}].source_weights")


def stage_problems(problems: Sequence[Problem], stage: StageSection | None, seed: int,
                   index: int, ids: Sequence[str] | None) -> list[Problem]:
    """What stage `index` of a run at `seed` trains on: its `source_weights` subset of the
    training `problems` (`asyncrl.tasks.stream.source_mix`), then, when a `hard` filter has
    run (`ids`), the problems it kept."""
    mixed = source_mix(problems, stage.source_weights if stage else {}, seed=seed, stage=index)
    if ids is None:
        return mixed
    keep = set(ids)
    return [p for p in mixed if p.id in keep]


def stage_budget(rollout: RolloutSection, stage: StageSection) -> int:
    return stage.max_response_tokens or rollout.max_response_tokens


def eval_temperature(cfg: RunConfig) -> float:
    """The temperature of an evaluation's sampled answers: `eval.temperature`, else the training
    temperature."""
    t = cfg.eval.temperature
    return cfg.rollout.temperature if t is None else t


def rollout_settings(cfg: RunConfig, fmt: ToolFormat, stop_token_ids: tuple[int, ...],
                     stage: StageSection | None, *, eval_: bool = False, seed_key: str = "",
                     temperature: float | None = None) -> RolloutSettings:
    """A stage's sampling settings (an eval's: `eval.temperature` unless `temperature` is
    given, top-p 1 and `eval.max_response_tokens` if set); with `rollout.seed_requests`, seeded
    by `run.seed` and `seed_key` (each call of the runner gets its own key: a wave, an eval, a
    filter)."""
    r = cfg.rollout
    budget = stage_budget(r, stage) if stage else r.max_response_tokens
    temp, top_p = r.temperature, r.top_p
    if eval_:
        budget = cfg.eval.max_response_tokens or budget
        temp = eval_temperature(cfg) if temperature is None else temperature
        top_p = 1.0
    return RolloutSettings(
        max_response_tokens=budget, max_turns=r.max_turns, temperature=temp, top_p=top_p,
        tool_format=fmt, tool_output_max_chars=r.tool_output_max_chars,
        tool_timeout_s=r.tool_timeout_s, stop_token_ids=stop_token_ids,
        seed=(zlib.crc32(f"{cfg.run.seed}:{seed_key}".encode()) & 0x7FFFFFFF
              if r.seed_requests else None),
    )
