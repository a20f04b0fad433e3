"""The stage sections of a curriculum (`[[stages]]` and what a stage holds: `[stages.chat]`,
`[stages.distill]` with its teacher, the plateau rule), composed into `RunConfig` by
`asyncrl.config.schema`.

Owns: those sections, their fields, defaults and checks within a stage. Does not own: checks
that span sections (`schema.RunConfig`), or running a stage (`asyncrl.train`, `asyncrl.stages`).
Imports nothing from the project but the config package's own types.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.config.base import (
    Fraction,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    _bad,
    _Section,
)
from asyncrl.config.components import EngineConfig, LocalEngineConfig


class PlateauRule(_Section, frozen=True, kw_only=True):
    metric: str = "eval/accuracy"
    """Metric watched for the plateau."""
    patience: PosInt = 3
    """Evaluations without improvement before the stage ends."""
    min_delta: NonNegFloat = 0.0
    """Improvement smaller than this counts as none."""


class SFTChatSection(_Section, frozen=True, kw_only=True):
    """An SFT stage fed from chat files (`[stages.chat]`) instead of generated transcripts."""

    train: list[str]
    """Chat files (`.jsonl`, `.json`, `.parquet`), rows in one of the layouts of
    `asyncrl.sft.layouts` (OpenAI messages, ShareGPT, Hermes, glaive, ToolACE, xLAM, Alpaca)."""
    valid: list[str] = []
    """Held-out chat files; empty splits `valid_fraction` of the training rows off instead."""
    valid_fraction: Fraction = 0.0
    """Share of training rows held out (a seeded, stable split by row) when `valid` is empty."""
    layout: Literal["auto", "openai", "sharegpt", "hermes", "glaive", "toolace", "xlam",
                    "alpaca"] = "auto"
    """Row layout of every file; `auto` detects it per row."""
    max_tokens: PosInt = 4096
    """A rendered row longer than this (tokens) is a bad row (`too_long`), skipped."""
    batch_tokens: NonNegInt = 0
    """Token budget of one optimizer step: rows are taken (in the epoch's order) until
    `batch_size` rows or this many tokens (0 = no token limit)."""
    max_bad_fraction: Fraction = 0.05
    """The stage refuses to start when more than this share of rows is bad."""
    valid_every: NonNegInt = 0
    """Held-out loss every N steps (0 = only at the end of the stage)."""
    shuffle: bool = True
    """Shuffle rows each epoch (seeded by `run.seed`); the cursor is checkpointed."""
    bucket_by_length: bool = False
    """Sort rows by length within windows of 32 batches before cutting them into steps (less
    padding across steps). Off by default: such steps share a length, and often a source or a
    kind of chat, which made the tiny parity bench's held-out loss worse (docs/recipe.md);
    the trainer already groups similar lengths into micro-batches within a step."""

    def __post_init__(self) -> None:
        if not self.train:
            raise _bad("train", "name at least one chat file")


class TeacherSection(_Section, frozen=True, kw_only=True):
    """The model a distill stage samples from instead of the policy (`[stages.distill.teacher]`)."""

    path: str
    """HF model directory (or, for a server engine, the model name it serves), loaded in
    `model.dtype` by a local engine. Its tokenizer must have the policy's vocabulary: the kept
    rollouts are trained token for token."""
    engine: EngineConfig = LocalEngineConfig()
    """The teacher's own engine (`[stages.distill.teacher.engine]`, any `engine.kind`; without
    `kind`, local). It is opened for the stage and closed after it, and never receives the
    policy's weights."""

    def __post_init__(self) -> None:
        if not self.path:
            raise _bad("path", "name the teacher model's directory")


class DistillSection(_Section, frozen=True, kw_only=True):
    """A distill stage's sampling and selection (`[stages.distill]`): rejection-sampling SFT
    from the model's own rollouts (or a teacher's) that the task's reward accepts."""

    rounds: PosInt = 1
    """Sample, select, train; this many times. Each round samples the policy as the previous
    round left it (a teacher does not change), and trains on every transcript kept so far."""
    samples_per_problem: PosInt = 8
    """Rollouts sampled per problem in each round (the stage's budget and the training
    temperature)."""
    max_per_problem: PosInt = 2
    """At most this many kept transcripts per problem, over all rounds (a problem at the cap
    is not sampled again)."""
    problems_per_round: NonNegInt = 0
    """Problems sampled in a round: a seeded random subset of those below the cap (0 = all)."""
    teacher: TeacherSection | None = None
    """Sample from this model instead of the policy (None: the policy, through `[engine]`)."""


class StageSection(_Section, frozen=True, kw_only=True):
    name: str
    """Stage name (used in logs and checkpoints)."""
    kind: Literal["sft", "rl", "distill"] = "rl"
    """`sft`: supervised cold start on generated transcripts. `rl`: GRPO-RoC. `distill`: a
    cold start from sampled rollouts the reward accepts (`[stages.distill]`), trained as SFT
    transcripts."""
    steps: PosInt
    """Maximum steps of this stage (optimizer steps for SFT and distill, RL steps for RL)."""
    max_response_tokens: NonNegInt = 0
    """Response budget for this stage; 0 keeps `rollout.max_response_tokens`."""
    source_weights: dict[str, PosFloat] = {}
    """Train this stage on a subset of the training problems with these shares by source: a
    key names a problem source (`Problem.source`) or its last part (`{ simple_equations = 1,
    gsm_symbolic = 1 }` for reasoning-gym's generators); a source not named is left out. The
    shares are reached by leaving problems out, never by repeating one: the source scarcest
    for its weight is taken whole, each other a seeded draw of its share (at least one
    problem), the same on a resume. A `hard` filter then samples from the subset, and keeps
    what it keeps whatever the shares. The stage's `stage` metrics row counts its problems
    by source. A key that names no source of the training set stops the run before its first
    stage (`asyncrl train --dry-run` names it too, for a generator source). Empty: every
    training problem."""
    data_filter: Literal["all", "hard"] = "all"
    """`hard`: before the stage, keep only problems the current policy does not solve k/k."""
    hard_filter_k: PosInt = 8
    """Samples per problem for the hard-problem filter."""
    hard_filter_problems: NonNegInt = 0
    """Problems examined by the filter: a seeded random subset of this size of the stage's
    problems (its `source_weights` mix; 0 = all)."""
    plateau: PlateauRule | None = None
    """End the stage early when the eval metric stops improving."""
    lr: NonNegFloat = 0.0
    """Learning rate for this stage; 0 keeps `algorithm.lr`."""
    lr_decay_steps: NonNegInt = 0
    """The last N steps of this stage take the learning rate linearly down to zero (a
    warmup-stable-decay schedule: a short cold start ends on settled weights, not on the
    noise of its last large steps). 0 = no decay."""
    batch_size: NonNegInt = 0
    """SFT: examples per optimizer step (0 = 16; for chat files with `chat.batch_tokens` set,
    0 = as many as the token budget holds)."""
    examples: NonNegInt = 0
    """SFT: generated transcripts to train on (0 = steps * batch_size)."""
    tool_fraction: Fraction = 0.5
    """SFT: share of transcripts that call the tool (the rest answer directly)."""
    tool_fraction_by_level: dict[str, Fraction] = {}
    """SFT: `tool_fraction` for the problems of one level (`{ "1" = 0.2, "3" = 0.8 }`)."""
    fail_fix_fraction: Fraction = 0.15
    """SFT: share of tool transcripts whose first call fails and is then fixed."""
    fail_fix_by_level: dict[str, Fraction] = {}
    """SFT: `fail_fix_fraction` for the problems of one level (`{ "4" = 0.7 }`); others keep it."""
    transcript_style: Literal["markup", "natural"] = "markup"
    """SFT: how generated transcripts word their reasoning: `markup` (the tiny model's terse
    `<reason>` lines) or `natural` (sentences, for a pretrained instruction-tuned model)."""
    sandbox_outputs: bool = False
    """SFT: the generated transcripts' tool outputs come from the run's sandbox (its
    tracebacks and measured times) instead of running the programs in process."""
    chat: SFTChatSection | None = None
    """SFT: train on chat files (`[stages.chat]`) instead of generated transcripts."""
    distill: DistillSection | None = None
    """Distill: its sampling and selection (None: the defaults of `DistillSection`)."""
