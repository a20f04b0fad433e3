"""`asyncrl train CONFIG`: the staged recipe, one RL step in a page.

Per RL step: prompts -> rollouts (the async rollout engine: streaming, tools mid-generation,
reward as each group ends) -> RoC (2G -> G, advantages) -> update -> weight sync -> log.
Stages run in order (SFT cold start, then RL stages); a stage ends at its step count or on a
plateau; a `hard` stage first keeps only the problems the current policy does not solve k/k.
Evaluation every N steps; checkpoints every N steps and at stage ends, resumable. A stop
(SIGINT / SIGTERM, `asyncrl.stopping`) aborts the rollouts under way, saves the last completed
step and leaves through the normal cleanup (`RunStopped`).

Owns: the order of things and the run state. Does not own: any component's internals.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl import config as config_mod
from asyncrl import log as logmod
from asyncrl.config import RunConfig, StageSection
from asyncrl.errors import CheckpointError, ConfigError, RunStopped, TrainerError
from asyncrl.observe.metrics import MetricsWriter, group_rollouts, numeric, rollout_stats
from asyncrl.observe.progress import RunProgress, StagePlan
from asyncrl.records import Batch, Group, Problem, save_jsonl
from asyncrl.rundir import pick_run_dir
from asyncrl.stages import (
    PlateauState,
    TrainState,
    eval_temperature,
    hard_problem_ids,
    plateau_update,
    stage_budget,
    stage_done,
    stage_lr,
)
from asyncrl.stopping import StopRequest, signal_handlers
from asyncrl.templates import end_of_sequence_ids

if TYPE_CHECKING:
    from asyncrl.rollout.producer import RolloutProducer
    from asyncrl.runtime import Runtime

log = logmod.get_logger(__name__)


class StageRunner:
    """Drives the stages over a live `Runtime` (the model trainer is `rt.trainer`, which it needs)."""

    def __init__(self, rt: Runtime, metrics: MetricsWriter, state: TrainState,
                 train_problems: list[Problem], eval_problems: list[Problem],
                 progress: RunProgress | None = None, stop: StopRequest | None = None) -> None:
        from asyncrl.data import ProblemStream

        self.rt = rt
        self.trainer = rt.need_trainer()
        self.progress = progress or RunProgress(rt.run_dir.name, stage_plans(rt.cfg))
        self.cfg: RunConfig = rt.cfg
        self.metrics = metrics
        self.state = state
        self.stop = stop or StopRequest()
        self._last_checkpoint = (state.stage_index, state.stage_step)  # saved or nothing done
        self.train_problems = train_problems
        self.eval_problems = eval_problems
        self.rng = random.Random(self.cfg.run.seed)
        if state.rng_state is not None:
            self.rng.setstate(_as_rng_state(state.rng_state))
        self._stream_cls = ProblemStream
        self.stream = self._make_stream()

    # ------------------------------------------------------------------------------ plumbing
    def _stage_problems(self) -> list[Problem]:
        ids = self.state.stage_problem_ids
        if ids is None:
            return self.train_problems
        keep = set(ids)
        return [p for p in self.train_problems if p.id in keep]

    def _make_stream(self) -> Any:
        probs = self._stage_problems()
        if self.state.data_cursor:
            return self._stream_cls.from_state(probs, self.state.data_cursor)
        return self._stream_cls(probs, seed=self.cfg.run.seed + self.state.stage_index,
                                shuffle=self.cfg.data.shuffle)

    def _settings(self, stage: StageSection | None, *, eval_: bool = False,
                  seed_key: str = "", temperature: float | None = None) -> Any:
        """A stage's sampling settings (an eval's: `eval.temperature` unless `temperature` is
        given); with `rollout.seed_requests`, seeded by `run.seed` and `seed_key` (each call of
        the runner gets its own key: a wave, an eval, a filter)."""
        from asyncrl.rollout import RolloutSettings

        r = self.cfg.rollout
        budget = stage_budget(r, stage) if stage else r.max_response_tokens
        temp, top_p = r.temperature, r.top_p
        if eval_:
            budget = self.cfg.eval.max_response_tokens or budget
            temp, top_p = (eval_temperature(self.cfg) if temperature is None else temperature,
                           1.0)
        return RolloutSettings(
            max_response_tokens=budget, max_turns=r.max_turns, temperature=temp, top_p=top_p,
            tool_format=self.rt.fmt, tool_output_max_chars=r.tool_output_max_chars,
            stop_token_ids=end_of_sequence_ids(self.rt.tokenizer),
            seed=(zlib.crc32(f"{self.cfg.run.seed}:{seed_key}".encode()) & 0x7FFFFFFF
                  if r.seed_requests else None),
        )

    async def _sync(self) -> float:
        """Push the trainer's weights to every engine; bumps the policy version."""
        t0 = time.monotonic()
        self.state.policy_version += 1
        await _push_weights(self.rt, self.state.policy_version)
        return time.monotonic() - t0

    async def _rollouts(self, problems: list[Problem], n: int, settings: Any) -> list[Group]:
        self.progress.rollouts_requested(len(problems) * n)

        async def collect() -> list[Group]:
            return [g async for g in self.rt.runner.run(problems, n, settings,
                                                        self.state.policy_version)]
        return await self.stop.race(collect())  # a stop aborts them

    # ---------------------------------------------------------------------------- the stages
    async def run(self) -> None:
        """Every stage from the state's; on a stop, save the last completed step and raise
        `RunStopped` (RL stages save inside `_run_rl`, where the waves under way are known)."""
        try:
            await self._run_stages()
        except RunStopped:
            await self._checkpoint(force=True)
            raise

    async def _run_stages(self) -> None:
        stages = self.cfg.stages
        while self.state.stage_index < len(stages):
            stage = stages[self.state.stage_index]
            with logmod.bound_contextvars(stage=stage.name):
                await self._run_stage(stage)
            self.state.stage_index += 1
            self.state.stage_step = 0
            self.state.plateau = PlateauState()
            self._plateaued = False
            self.state.data_cursor = {}
            self.state.sft_cursor = {}
            self.state.stage_problem_ids = None
            if self.state.stage_index < len(stages):
                self.stream = self._make_stream()
        await self.evaluate(label="final")

    async def _run_stage(self, stage: StageSection) -> None:
        self.trainer.set_lr(stage_lr(stage, self.cfg.algorithm.lr))
        self.progress.stage_start(self.state.stage_index, self.state.stage_step)
        self.metrics.write("stage", stage=stage.name, step=self.state.global_step,
                           event="start", kind_=stage.kind)
        log.info("stage_start", kind=stage.kind, steps=stage.steps)
        if stage.kind == "sft":
            if not self.state.eval_due:  # set: a stop came during the eval, steps and sync done
                await self._run_sft(stage)
                await self._sync()
                self.state.eval_due = True
            await self.evaluate(label="after_sft", stage=stage)
            self.state.eval_due = False
        else:
            if stage.data_filter == "hard" and self.state.stage_problem_ids is None:
                await self._filter_hard(stage)
            await self._run_rl(stage)
        await self._checkpoint(force=True)

    async def _run_rl(self, stage: StageSection) -> None:
        """The RL steps of a stage over a `RolloutProducer`, which keeps up to
        `max_staleness + 1` steps' rollouts under way across updates; this scope owns it and
        cancels what is left when the stage ends."""
        from asyncrl.rollout.producer import RolloutProducer

        n = self.cfg.rollout.samples_per_prompt
        # waves are issued in step order, the resumed ones first (see RolloutProducer)
        wave_no = itertools.count(self.state.stage_step)

        def run_wave(problems: list[Problem], version: int) -> Any:
            self.progress.rollouts_requested(len(problems) * n)
            settings = self._settings(
                stage, seed_key=f"rl:{self.state.stage_index}:{next(wave_no)}")
            return self.rt.runner.run(problems, n, settings, version)

        if self.cfg.rollout.max_staleness > 0 and self.cfg.algorithm.correction == "none":
            log.warning("staleness_without_correction", max_staleness=self.cfg.rollout.max_staleness,
                        hint="stale tokens are trained as on-policy; see docs/async.md")
        by_id = {p.id: p for p in self.train_problems}
        resume = [by_id[i] for i in self.state.pending_problem_ids if i in by_id]
        self.state.pending_problem_ids = []
        async with RolloutProducer(run_wave, self.stream.next_batch,
                                   prompts_per_step=self.cfg.rollout.prompts_per_step,
                                   max_staleness=self.cfg.rollout.max_staleness,
                                   waves_total=max(0, stage.steps - self.state.stage_step),
                                   version=lambda: self.state.policy_version,
                                   resume_problems=resume) as prod:
            self._producer = prod
            try:
                if self.state.eval_due:  # a stop aborted the last step's eval: it runs first
                    await self._step_eval(stage)
                while not stage_done(stage, self.state.stage_step, self._plateaued):
                    self.stop.check()
                    await self.rl_step(stage, prod)
            except RunStopped:
                await prod.aclose()  # abort the waves under way: they are regenerated on resume
                await self._checkpoint(force=True)
                raise
            finally:
                self._producer = None

    _plateaued = False
    _producer: RolloutProducer | None = None

    async def _run_sft(self, stage: StageSection) -> None:
        from asyncrl.sft.stage import run_sft

        await run_sft(stage, self.cfg, self.rt, self.state, self.metrics, self.train_problems,
                      lambda: self._checkpoint(force=True),
                      on_step=lambda loss: self.progress.step(
                          self.state.stage_step, self.state.global_step, loss=loss),
                      stop=self.stop)

    async def _filter_hard(self, stage: StageSection) -> None:
        """Keep the problems the current policy does not solve k/k (sampled, training temp)."""
        t0 = time.monotonic()
        probs = self.train_problems
        if stage.hard_filter_problems and stage.hard_filter_problems < len(probs):
            probs = random.Random(self.cfg.run.seed + self.state.stage_index).sample(
                probs, stage.hard_filter_problems)
        groups = await self._rollouts(probs, stage.hard_filter_k, self._settings(
            stage, seed_key=f"filter:{self.state.stage_index}"))
        correct = {g.problem.id: sum(r.reward > 0 for r in g.rollouts) for g in groups}
        hard = hard_problem_ids(correct, stage.hard_filter_k)
        if not hard:  # everything solved: keep training on all rather than on nothing
            hard = set(correct)
        self.state.stage_problem_ids = sorted(hard)
        self.state.data_cursor = {}
        self.stream = self._make_stream()
        self.metrics.write("hard_filter", stage=stage.name, step=self.state.global_step,
                           problems=len(probs), hard=len(hard),
                           seconds=round(time.monotonic() - t0, 2))
        log.info("hard_filter", problems=len(probs), hard=len(hard))

    async def rl_step(self, stage: StageSection, prod: RolloutProducer) -> None:
        """One RL step on the next wave of `prod` (a `RolloutProducer`): its groups were
        sampled up to `max_staleness` versions ago, some of their tokens maybe while this
        step's predecessors were updating the engines."""
        from asyncrl.algo.roc import apply_roc
        from asyncrl.algo.staleness import group_lag, split_stale, version_stats

        cfg = self.cfg
        t_step = time.monotonic()
        step = self.state.global_step + 1
        with logmod.bound_contextvars(step=step, policy_version=self.state.policy_version):
            wave = await self.stop.race(prod.take())  # a stop now: the step never happened
            self.state.global_step = step
            wait_s = time.monotonic() - t_step
            problems, groups = wave.problems, wave.groups
            rollout_s = (wave.finished or time.monotonic()) - wave.started
            version = self.state.policy_version
            behind = max((group_lag(g, version) for g in groups), default=0)
            fresh, stale = split_stale(groups, version, cfg.rollout.max_staleness)
            async_m = {**version_stats(fresh, version), **prod.stats(),
                       "async/groups_kept": float(len(fresh)),
                       "async/groups_dropped_stale": float(len(stale)),
                       "async/wave_version_lag": float(version - wave.started_version),
                       "timing/wait_rollouts_s": wait_s}
            kept, roc_m = apply_roc(groups, cfg.roc, cfg.rollout.group_size, self.rng,
                                    adv_eps=cfg.algorithm.adv_eps)
            roc_m["roc/groups_stale"] = float(len(stale))
            roc_m["roc/versions_behind_max"] = float(behind)
            batch = Batch(step=step, policy_version=self.state.policy_version, groups=kept)
            t0 = time.monotonic()
            train_m: dict[str, float] = {}
            if kept:
                if stage.lr_decay_steps:
                    self.trainer.set_lr(stage_lr(stage, cfg.algorithm.lr, self.state.stage_step))
                train_m = await asyncio.to_thread(self.trainer.train_step, batch)
            update_s = time.monotonic() - t0
            sync_s = await self._sync() if kept else 0.0
            self.state.stage_step += 1
            prod.step_done()  # the next wave(s) may start: they sample the new version
            rolls = group_rollouts(groups)
            stats = rollout_stats(rolls)
            step_s = time.monotonic() - t_step
            row = {
                "stage": stage.name, "step": step, "policy_version": self.state.policy_version,
                "problem_ids": [p.id for p in problems],
                "reward/mean": stats.get("rollout/reward_mean", 0.0),
                "train/accuracy": stats.get("rollout/reward_mean", 0.0),
                **stats, **numeric(roc_m, "roc/"), **numeric(train_m), **async_m,
                "timing/rollout_s": rollout_s,
                "timing/tool_wait_s": sum(r.timing.tool_wait_s for r in rolls),
                "timing/update_s": update_s, "timing/sync_s": sync_s,
                "timing/step_s": step_s,
            }
            self.metrics.write("rl_step", **row)
            self.progress.step(self.state.stage_step, step,
                               reward=stats.get("rollout/reward_mean", 0.0))
            keep_every = cfg.logging.rollouts_every
            if keep_every and step % keep_every == 0:  # the whole wave, RoC's marks included
                await asyncio.to_thread(save_jsonl, self.rt.run_dir / "rollouts" /
                                        f"step_{step:06d}.jsonl", groups)
            log.info("rl_step", reward=round(stats.get("rollout/reward_mean", 0.0), 3),
                     tool_err_pos=round(stats.get("rollout/tool_error_ratio_pos", 0.0), 3),
                     kept_groups=len(kept), seconds=round(step_s, 2),
                     lag_max=async_m["async/version_lag_max"])
            every = cfg.eval.every_steps
            # The run's last step is scored by the final evaluation that follows it, on the
            # same weights: a step evaluation there would only repeat it.
            last = (self.state.stage_index == len(cfg.stages) - 1
                    and self.state.stage_step >= stage.steps)
            if every and self.state.stage_step % every == 0 and not last:
                await self._step_eval(stage)
            await self._checkpoint()

    async def _step_eval(self, stage: StageSection) -> None:
        """A step's evaluation and the plateau rule; a stop during it leaves `eval_due` set in
        the checkpoint, so a resumed run evaluates that step before going on."""
        self.state.eval_due = True
        m = await self.evaluate(label="step", stage=stage)
        self.state.eval_due = False
        if stage.plateau is not None:
            self.state.plateau, self._plateaued = plateau_update(
                stage.plateau, self.state.plateau, m)

    async def evaluate(self, label: str, stage: StageSection | None = None) -> dict[str, float]:
        """k sampled answers per problem at `eval.temperature` and, with `eval.greedy`, one
        greedy answer (`asyncrl.evaluation.with_greedy`); every rollout of both is kept under
        `eval/` (`{step}-{label}.jsonl`, the greedy pass's `{step}-{label}-greedy.jsonl`)."""
        from asyncrl.evaluation import summarize, with_greedy

        probs = self.eval_problems
        if not probs:
            return {}
        ev = self.cfg.eval
        if ev.max_problems:
            probs = probs[: ev.max_problems]
        t0 = time.monotonic()
        temp = eval_temperature(self.cfg)
        key = f"eval:{self.state.global_step}:{label}"
        groups = await self._rollouts(probs, ev.k, self._settings(stage, eval_=True,
                                                                  seed_key=key))
        summary = summarize(groups, ev.k)
        out = self.rt.run_dir / "eval" / f"{self.state.global_step:06d}-{label}"
        await asyncio.to_thread(save_jsonl, out.with_suffix(".jsonl"), groups)
        if ev.greedy and temp > 0:
            greedy = await self._rollouts(probs, 1, self._settings(
                stage, eval_=True, seed_key=key + ":greedy", temperature=0.0))
            summary = with_greedy(summary, summarize(greedy, 1))
            await asyncio.to_thread(save_jsonl, out.with_name(out.name + "-greedy.jsonl"),
                                    greedy)
        summary["temperature"] = temp
        m = {f"eval/{k}": v for k, v in summary.items()}
        self.metrics.write("eval", label=label, stage=stage.name if stage else "",
                           step=self.state.global_step, seconds=time.monotonic() - t0, **m)
        self.progress.evaluated(self.state.global_step, m["eval/accuracy"])
        log.info("eval", label=label, accuracy=round(m["eval/accuracy"], 4), problems=len(probs))
        return m

    async def _checkpoint(self, force: bool = False) -> None:
        """Write a checkpoint in a worker thread: rollouts of the next steps may be in flight
        (the producer's waves), and weights, optimizer state and fsyncs would stall them.
        Nothing else touches the trainer until this returns (the step awaits it)."""
        from asyncrl.checkpoint import save_checkpoint

        every = self.cfg.checkpoint.every_steps
        if not force and not (every and self.state.global_step % every == 0):
            return
        key = (self.state.stage_index, self.state.stage_step)
        if key == self._last_checkpoint:
            return
        self._last_checkpoint = key
        self.state.data_cursor = self.stream.state()
        prod = self._producer  # waves under way: regenerated on resume (see TrainState)
        self.state.pending_problem_ids = ([p.id for p in prod.pending_problems()]
                                          if prod is not None else [])
        self.state.rng_state = self.rng.getstate()
        self.state.metrics_rows = self.metrics.rows
        st = self.state
        sft = self.cfg.stages[min(st.stage_index, len(self.cfg.stages) - 1)].kind == "sft"
        # the RL step does not move during SFT: an SFT stage's checkpoints have their own names
        name = f"sft_{st.stage_index:02d}_{st.stage_step:08d}" if sft else None
        await asyncio.to_thread(save_checkpoint, self.rt.run_dir, st.global_step,
                                self.trainer, msgspec.to_builtins(st),
                                keep_last=self.cfg.checkpoint.keep_last, name=name,
                                order=(st.global_step, st.stage_index, st.stage_step))


def _as_rng_state(s: Any) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


# ------------------------------------------------------------------------------- entry points
def dry_run(cfg: RunConfig, *, missing: list[ConfigError] | None = None) -> list[str]:
    """Resolve every stage, data file and component without starting anything heavy.

    Returns the plan as lines. An unknown component always raises `ConfigError`. A path that
    is not on this machine (model, data or chat file) raises `ConfigError` naming its key
    when `missing` is None; given a list, each such error is appended to it instead and the
    plan goes on, so a recipe meant for another machine still resolves in full.
    """
    from asyncrl.engine.registry import ENGINE_KINDS
    from asyncrl.trainer import TRAINER_KINDS

    def absent(key: str, message: str) -> None:
        if missing is None:
            raise ConfigError(key, message)
        missing.append(ConfigError(key, message))

    lines = []
    if cfg.model.path:
        if not Path(cfg.model.path).exists():
            absent("model.path", f"no such directory: {cfg.model.path}")
        lines.append(f"model: {cfg.model.path} ({cfg.model.dtype})")
    else:
        lines.append(f"model: built from model.init ({cfg.model.init.get('model_type')})")
    for key in ("train", "eval"):
        src = getattr(cfg.data, key)
        if src and not src.startswith("generator:") and not Path(src).exists():
            absent(f"data.{key}", f"no such file: {src}")
        lines.append(f"data.{key}: {src or '(none)'}")
    if cfg.engine.kind not in ENGINE_KINDS:
        raise ConfigError("engine.kind", f"engine {cfg.engine.kind!r} is not available here")
    if cfg.trainer.kind not in TRAINER_KINDS:
        raise ConfigError("trainer.kind", f"trainer {cfg.trainer.kind!r} is not available here")
    lines.append(f"engine: {cfg.engine.kind}; trainer: {cfg.trainer.kind}; "
                 f"sandbox: {cfg.sandbox.kind}")
    r = cfg.rollout
    lines.append(f"rollout: {r.prompts_per_step} prompts x {r.samples_per_prompt} samples -> "
                 f"{r.group_size} kept (roc={cfg.roc.kind}/{cfg.roc.positive}), "
                 f"format={r.tool_format}, temperature={r.temperature}")
    for i, st in enumerate(cfg.stages):
        for key, files in (("train", st.chat.train), ("valid", st.chat.valid)) if st.chat else ():
            for f in files:
                if not Path(f).exists():
                    absent(f"stages[{i}].chat.{key}", f"no such file: {f}")
        extra = f", filter=hard(k={st.hard_filter_k})" if st.data_filter == "hard" else ""
        if st.chat is not None:
            extra += f", chat files: {len(st.chat.train)} (layout {st.chat.layout})"
        plateau = f", plateau({st.plateau.metric}, {st.plateau.patience})" if st.plateau else ""
        lines.append(f"stage {i} {st.name}: {st.kind}, {st.steps} steps, budget "
                     f"{stage_budget(cfg.rollout, st)}, lr {stage_lr(st, cfg.algorithm.lr)}"
                     f"{extra}{plateau}")
    return lines


def stage_plans(cfg: RunConfig) -> list[StagePlan]:
    return [StagePlan(st.name, st.kind, st.steps) for st in cfg.stages]


def stop_summary(run_dir: Path, resume_command: str = "") -> str:
    """What a stopped run has on disk, in a sentence: its newest checkpoint and how to go on."""
    from asyncrl.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return "No checkpoint yet: a new run starts from the beginning."
    return (f"Newest checkpoint: {ckpt}." + (f" Resume with: {resume_command}"
                                            if resume_command else ""))


async def train_async(cfg: RunConfig, *, resume: bool = False, run_dir: str | None = None,
                      stop: StopRequest | None = None, resume_command: str = "") -> Path:
    """Run the whole curriculum; returns the run directory (`asyncrl.rundir.pick_run_dir`).

    SIGINT / SIGTERM stop it (`checkpoint.on_signal`, `asyncrl.stopping`): it then raises
    `RunStopped` once the last completed step is saved and everything is closed.
    `resume_command` is printed if the grace period runs out."""
    stop = stop or StopRequest()
    rd, _ = pick_run_dir(cfg, run_dir, resume)
    c = cfg.checkpoint
    with signal_handlers(stop, c.signal_grace_s, enabled=c.on_signal,
                         describe=lambda: stop_summary(rd, resume_command)):
        try:
            return await _train(cfg, resume, rd, stop)
        except RunStopped as e:
            e.run_dir = rd
            from asyncrl.checkpoint import latest_checkpoint

            e.checkpoint = latest_checkpoint(rd)
            log.warning("run_stopped", signal=e.signal_name, where=e.where,
                        checkpoint=str(e.checkpoint), seconds=round(
                            time.monotonic() - (stop.at or time.monotonic()), 2))
            raise


async def _train(cfg: RunConfig, resume: bool, rd: Path, stop: StopRequest) -> Path:
    from asyncrl.checkpoint import list_checkpoints, load_checkpoint
    from asyncrl.data import load_split
    from asyncrl.observe.progress import instrument, progress_display
    from asyncrl.observe.sinks import open_sinks
    from asyncrl.runtime import open_runtime

    await asyncio.to_thread(rd.mkdir, parents=True, exist_ok=True)
    logmod.configure(cfg.logging.level, cfg.logging.console, run_dir=rd)
    logmod.bind_contextvars(run=rd.name)
    config_mod.write_resolved(cfg, rd)
    log.info("run_start", run_dir=str(rd), resume=resume)
    t_start = time.monotonic()
    state = TrainState()
    ckpts = [p for _, p in reversed(list_checkpoints(rd))] if resume else []
    if resume and not ckpts:
        log.warning("resume_without_checkpoint", run_dir=str(rd),
                    hint="no checkpoint yet: the run starts from the beginning")
    progress = RunProgress(rd.name, stage_plans(cfg))
    ckpt = None
    async with open_runtime(cfg, rd) as rt:
        for candidate in ckpts:  # newest first; an unreadable one falls back, loudly
            try:
                saved = await asyncio.to_thread(load_checkpoint, candidate, rt.need_trainer())
                state = msgspec.convert(saved, TrainState)
            except (CheckpointError, TrainerError, msgspec.ValidationError) as e:
                log.warning("checkpoint_unreadable", checkpoint=str(candidate), error=str(e),
                            hint="resuming from the one before it")
                continue
            ckpt = candidate
            break
        if ckpts and ckpt is None:
            raise CheckpointError(f"no checkpoint of {rd} can be read (tried "
                                  f"{', '.join(p.name for p in ckpts)}); refusing to restart "
                                  "from the beginning: start a new run without --resume")
        if ckpt is not None:
            await _push_weights(rt, state.policy_version)
            log.info("resumed", checkpoint=str(ckpt), step=state.global_step,
                     stage=cfg.stages[min(state.stage_index, len(cfg.stages) - 1)].name)
        instrument(rt.runner, progress)
        tools = [t.schema for t in rt.tools] or None
        d = cfg.data
        train = load_split(d.train, d.generator_options, cfg.run.seed, "train", rt.tokenizer,
                           rt.fmt, tools, d.max_prompt_tokens, d.system_prompt)
        evals = (load_split(d.eval, d.generator_options, cfg.run.seed, "eval", rt.tokenizer,
                            rt.fmt, tools, d.max_prompt_tokens, d.system_prompt)
                 if d.eval else None)
        train_p, eval_p = train.problems, (evals.problems if evals is not None else [])
        n_long = (train.skipped.get("overlong_prompt", 0)
                  + (evals.skipped.get("overlong_prompt", 0) if evals is not None else 0))
        sinks = open_sinks(cfg.logging, rd, config_mod.to_dict(cfg))
        with MetricsWriter(rd, start_time=t_start, sinks=sinks) as metrics, \
                progress_display(progress, cfg.logging.progress):
            if ckpt is not None:  # rows the stopped attempt wrote after ckpt are redone now
                metrics.write("resumed", step=state.global_step, checkpoint=ckpt.name,
                              keep_rows=state.metrics_rows)
            metrics.write("data", step=state.global_step, train=len(train_p), eval=len(eval_p),
                          overlong_skipped=n_long)
            loop = StageRunner(rt, metrics, state, train_p, eval_p, progress, stop)
            try:
                await loop.run()
            except RunStopped as e:
                st = cfg.stages[min(state.stage_index, len(cfg.stages) - 1)]
                e.where = (f"stage {st.name} step {state.stage_step}/{st.steps}, "
                           f"RL step {state.global_step}")
                metrics.write("stopped", step=state.global_step, signal=e.signal_name,
                              stage=st.name, stage_step=state.stage_step)
                raise
            metrics.write("done", step=state.global_step,
                          wall_s=round(time.monotonic() - t_start, 1))
        rt.need_trainer().export_hf(rd / "final")
        rt.tokenizer.save_pretrained(rd / "final")  # a complete HF directory for every tool
    from asyncrl.observe.report import write_report

    report = write_report(rd)
    log.info("run_done", run_dir=str(rd), report=str(report),
             viewer=str(report.parent / "viewer.html"),
             wall_s=round(time.monotonic() - t_start, 1))
    return rd


async def _push_weights(rt: Runtime, version: int) -> None:
    """New weights to every engine, the way `engine.weight_sync` says (each engine kind has
    its own default): `asyncrl.engine.weightsync.push_weights`."""
    from asyncrl.engine.weightsync import push_weights

    await push_weights(rt.engines, rt.need_trainer(), version, rt.cfg.engine.weight_sync,
                       Path(rt.run_dir), group=rt.weight_group)
