"""`asyncrl train CONFIG`: the staged recipe, one RL step in a page.

Per RL step: prompts -> rollouts (the async rollout engine: streaming, tools mid-generation,
reward as each group ends) -> RoC (2G -> G, advantages) -> update -> weight sync -> log.
Stages run in order (an SFT or distill cold start, then RL stages); a stage ends at its step
count or on a plateau; a `hard` stage first keeps only the problems the current policy does not
solve k/k.
Evaluation every N steps; checkpoints every N steps and at stage ends, resumable. A stop
(SIGINT / SIGTERM, `asyncrl.stopping`) aborts the rollouts under way, saves the last completed
step and leaves through the normal cleanup (`RunStopped`).

Owns: the order of things and the run state. Does not own: any component's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from asyncrl import config as config_mod
from asyncrl import log as logmod
from asyncrl import modeling
from asyncrl.algo.roc import apply_roc, may_carry_signal
from asyncrl.algo.schedule import stage_lr
from asyncrl.algo.staleness import group_lag, split_stale, version_stats
from asyncrl.checkpoint import latest_checkpoint, load_newest, save_checkpoint
from asyncrl.config import DistillSection, RunConfig, StageSection
from asyncrl.errors import RunStopped, StepAbandoned
from asyncrl.formats import PYTHON_TOOL, shows_tool_time
from asyncrl.observe.evaluation import some_answered, summarize, with_greedy
from asyncrl.observe.journal import GroupJournal, discard
from asyncrl.observe.metrics import MetricsWriter, group_rollouts, numeric, rollout_stats
from asyncrl.observe.progress import RunProgress, StagePlan, instrument, progress_display
from asyncrl.observe.report import write_report
from asyncrl.observe.sinks import open_sinks
from asyncrl.records import Batch, Group, Problem, Rollout, in_problem_order, save_jsonl
from asyncrl.rollout import RolloutRunner
from asyncrl.rollout.agent import RolloutSettings
from asyncrl.rollout.producer import RolloutProducer, Wave
from asyncrl.rundir import pick_run_dir
from asyncrl.runtime import Runtime, open_runtime
from asyncrl.sft.distill import open_teacher, run_distill
from asyncrl.sft.stage import SFTSetup, run_sft
from asyncrl.stages import (
    PlateauState,
    TrainState,
    as_rng_state,
    check_source_weights,
    eval_temperature,
    hard_problem_ids,
    plateau_update,
    rollout_settings,
    stage_done,
    stage_problems,
)
from asyncrl.stopping import RL_GIVE_UP, StopRequest, signal_handlers, trainer_step
from asyncrl.tasks.files import LoadResult
from asyncrl.tasks.stream import (
    ProblemStream,
    filter_split,
    held_out_cut,
    source_counts,
)
from asyncrl.templates import end_of_sequence_ids
from asyncrl.weightsync.push import push_weights

log = logmod.get_logger(__name__)


class StageRunner:
    """Drives the stages over a live `Runtime` (the model trainer is `rt.trainer`, which it needs)."""

    def __init__(self, rt: Runtime, metrics: MetricsWriter, state: TrainState,
                 train_problems: list[Problem], eval_problems: list[Problem],
                 progress: RunProgress | None = None, stop: StopRequest | None = None) -> None:
        self.rt = rt
        self.trainer = rt.need_trainer()
        self.progress = progress or RunProgress(rt.run_dir.name, StagePlan.of(rt.cfg))
        self.cfg: RunConfig = rt.cfg
        self.metrics = metrics
        self.state = state
        self.stop = stop or StopRequest()
        self._last_checkpoint = (state.stage_index, state.stage_step)  # saved or nothing done
        self.train_problems = train_problems
        self.eval_problems = eval_problems
        self.rng = random.Random(self.cfg.run.seed)
        if state.rng_state is not None:
            self.rng.setstate(as_rng_state(state.rng_state))
        self._stop_ids = end_of_sequence_ids(rt.tokenizer)
        self._plateaued = False
        """The current stage's plateau rule fired: it ends after this step."""
        self._producer: RolloutProducer | None = None
        """The RL stage's producer while one runs (its waves under way go in a checkpoint)."""
        # again after the prompt-length filter (`open_runtime` checked the problems as read):
        # a source whose prompts are all too long fails now, not when its stage starts
        check_source_weights(self.cfg.stages, train_problems, self.cfg.run.seed)
        self.stream = self._make_stream()

    # ------------------------------------------------------------------------------ plumbing
    def _stage_problems(self) -> list[Problem]:
        i, stages = self.state.stage_index, self.cfg.stages
        return stage_problems(self.train_problems, stages[i] if i < len(stages) else None,
                              self.cfg.run.seed, i, self.state.stage_problem_ids)

    def _make_stream(self) -> ProblemStream:
        probs = self._stage_problems()
        if self.state.data_cursor:
            return ProblemStream.from_state(probs, self.state.data_cursor)
        return ProblemStream(probs, seed=self.cfg.run.seed + self.state.stage_index,
                                shuffle=self.cfg.data.shuffle)

    def _settings(self, stage: StageSection | None, **kw: Any) -> RolloutSettings:
        """`stages.rollout_settings` for this run's format and stop tokens."""
        return rollout_settings(self.cfg, self.rt.fmt, self._stop_ids, stage, **kw)

    async def _sync(self) -> float:
        """Push the trainer's weights to every engine; bumps the policy version."""
        t0 = time.monotonic()
        self.state.policy_version += 1
        await _push_weights(self.rt, self.state.policy_version)
        return time.monotonic() - t0

    async def _rollouts(self, problems: list[Problem], n: int, settings: RolloutSettings,
                        runner: RolloutRunner | None = None,
                        journal: GroupJournal | None = None) -> list[Group]:
        """Rollouts of an evaluation, a filter or a distill round (`runner`: the run's, or
        a teacher's); an evaluation's groups are journaled as they finish."""
        runner = runner or self.rt.runner

        def run(rest: list[Problem]) -> AsyncIterator[Group]:
            self.progress.rollouts_requested(len(rest) * n)  # a journal's are done already
            return runner.run(rest, n, settings, self.state.policy_version)

        async def collect() -> list[Group]:
            if journal is not None:
                return await journal.collect(problems, run)
            self.progress.rollouts_requested(len(problems) * n)
            return in_problem_order([g async for g in runner.run(
                problems, n, settings, self.state.policy_version)], problems)
        # a stop aborts them; none answered (every one failed) stops the run
        return some_answered(await self.stop.race(collect()),
                             "an evaluation, a filter or a distill round")

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
            self.state.sft_loss_window = []
            self.state.stage_problem_ids = None
            if self.state.stage_index < len(stages):
                self.stream = self._make_stream()
        # A run that ends in a cold-start stage (an ablation's shared SFT run) was scored on
        # these weights by that stage's own evaluation: a final one would only repeat it.
        if not stages or stages[-1].kind == "rl":
            await self.evaluate(label="final")

    async def _run_stage(self, stage: StageSection) -> None:
        self.trainer.set_lr(stage_lr(stage, self.cfg.algorithm.lr))
        self.progress.stage_start(self.state.stage_index, self.state.stage_step)
        probs = self._stage_problems()  # per source: what a `source_weights` mix left
        mix = {"problems": len(probs), "by_source": source_counts(probs)}
        self.metrics.write("stage", stage=stage.name, step=self.state.global_step,
                           event="start", stage_kind=stage.kind, **mix)
        log.info("stage_start", kind=stage.kind, steps=stage.steps, **mix)
        if stage.kind != "rl":  # sft, distill: steps, then a sync and an evaluation
            if not self.state.eval_due:  # set: a stop came during the eval, steps and sync done
                await (self._run_sft(stage) if stage.kind == "sft"
                       else self._run_distill(stage))
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
        r, n, base = self.cfg.rollout, self.cfg.rollout.samples_per_prompt, self.state.stage_step

        # waves are issued in step order, the resumed ones first (see RolloutProducer)
        def run_wave(problems: list[Problem], version: int, wave: int, part: int
                     ) -> AsyncIterator[Group]:  # part j > 0: the wave's j-th refill
            self.progress.rollouts_requested(len(problems) * n)
            key = f"rl:{self.state.stage_index}:{base + wave}" + (f":r{part}" if part else "")
            return self.rt.runner.run(problems, n, self._settings(stage, seed_key=key), version)

        if self.cfg.rollout.max_staleness > 0 and self.cfg.algorithm.correction == "none":
            log.warning("staleness_without_correction", max_staleness=self.cfg.rollout.max_staleness,
                        hint="stale tokens are trained as on-policy; see docs/async.md")
        by_id = {p.id: p for p in self.train_problems}
        resume = [by_id[i] for i in self.state.pending_problem_ids if i in by_id]
        self.state.pending_problem_ids = []
        async with RolloutProducer(run_wave, self.stream.next_batch,
                                   prompts_per_step=r.prompts_per_step,
                                   max_staleness=r.max_staleness,
                                   waves_total=max(0, stage.steps - self.state.stage_step),
                                   version=lambda: self.state.policy_version,
                                   resume_problems=resume, refill_max=r.refill_equal_reward,
                                   informative=lambda g: may_carry_signal(
                                       g, self.cfg.roc, r.group_size)) as prod:
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

    def _sft_setup(self) -> SFTSetup:
        cfg, rt = self.cfg, self.rt
        return SFTSetup(trainer=self.trainer, tokenizer=rt.tokenizer, fmt=rt.fmt,
                        tools=[t.schema for t in rt.tools] or None,
                        system_prompt=cfg.data.system_prompt, seed=cfg.run.seed,
                        shuffle=cfg.data.shuffle, lr=cfg.algorithm.lr,
                        tool_output_max_chars=cfg.rollout.tool_output_max_chars,
                        checkpoint_every=cfg.checkpoint.sft_every_steps,
                        show_tool_time=shows_tool_time(cfg.rollout.tool_time,
                                                       cfg.rollout.seed_requests),
                        python_tool=next((t for t in rt.tools if t.name == PYTHON_TOOL), None),
                        solution_code=rt.task.solution_code)

    def _on_sft_step(self, loss: float | None) -> None:
        self.progress.step(self.state.stage_step, self.state.global_step, loss=loss)

    async def _run_sft(self, stage: StageSection) -> None:
        await run_sft(stage, self._sft_setup(), self.state, self.metrics, self._stage_problems(),
                      lambda: self._checkpoint(force=True), on_step=self._on_sft_step,
                      stop=self.stop)

    async def _run_distill(self, stage: StageSection) -> None:
        """Rejection-sampling SFT (`asyncrl.sft.distill`): the policy's rollouts, through the
        run's engines (synced between rounds), or a teacher's, through engines of its own
        opened for the stage; sampled at the training temperature and the stage's budget."""
        rt, i = self.rt, self.state.stage_index
        teacher = (stage.distill or DistillSection()).teacher
        async with contextlib.AsyncExitStack() as stack:
            runner = rt.runner
            sync: Callable[[], Awaitable[float]] | None = self._sync
            if teacher is not None:
                engines = await stack.enter_async_context(open_teacher(
                    teacher, f"stages[{i}].distill.teacher", rt.tokenizer,
                    self.cfg.model.dtype, rt.run_dir))
                # the policy's prompt, tools and reward: only the model sampling differs
                base = rt.runner
                runner = RolloutRunner(engines, rt.tokenizer, base.tools, base.reward_fn,
                                       system_prompt=base.system_prompt, env=base.env,
                                       reward_timeout_s=base.reward_timeout_s)
                sync = None

            async def sample(problems: list[Problem], n: int, r: int) -> list[Group]:
                return await self._rollouts(problems, n, self._settings(
                    stage, seed_key=f"distill:{i}:{r}"), runner=runner)

            await run_distill(stage, self._sft_setup(), self.state, self.metrics,
                              self._stage_problems(), sample, sync,
                              rt.run_dir / "distill" / stage.name,
                              lambda: self._checkpoint(force=True),
                              on_step=self._on_sft_step, stop=self.stop)

    async def _filter_hard(self, stage: StageSection) -> None:
        """Keep the problems the current policy does not solve k/k (sampled, training temp)."""
        t0 = time.monotonic()
        probs = self._stage_problems()  # the stage's mix; nothing filtered yet
        if stage.hard_filter_problems and stage.hard_filter_problems < len(probs):
            probs = random.Random(self.cfg.run.seed + self.state.stage_index).sample(
                probs, stage.hard_filter_problems)
        groups = await self._rollouts(probs, stage.hard_filter_k, self._settings(
            stage, seed_key=f"filter:{self.state.stage_index}"))
        correct = {g.problem.id: sum(r.is_correct for r in g.rollouts) for g in groups}
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
        step's predecessors were updating the engines. Groups more than `max_staleness`
        versions behind are dropped before RoC."""
        cfg = self.cfg
        t_step = time.monotonic()
        step = self.state.global_step + 1
        with logmod.bound_contextvars(step=step, policy_version=self.state.policy_version):
            wave = await self.stop.race(prod.take())  # a stop now: the step never happened
            some_answered(wave.groups, f"RL step {step}")
            self.state.global_step = step
            version = self.state.policy_version
            fresh, stale = split_stale(wave.groups, version, cfg.rollout.max_staleness)
            rng_before = self.rng.getstate()  # a given-up step leaves the state as it found
            kept, roc_m = apply_roc(fresh, cfg.roc, cfg.rollout.group_size, self.rng,
                                    adv_eps=cfg.algorithm.adv_eps)
            roc_m["roc/groups_stale"] = float(len(stale))
            roc_m["roc/versions_behind_max"] = float(
                max((group_lag(g, version) for g in wave.groups), default=0))
            async_m = {**version_stats(fresh, version), **prod.stats(),
                       "async/groups_kept": float(len(fresh)),
                       "async/groups_dropped_stale": float(len(stale)),
                       "async/refilled": float(wave.refilled),
                       "async/wave_version_lag": float(version - wave.started_version),
                       "timing/wait_rollouts_s": time.monotonic() - t_step}
            t0 = time.monotonic()
            train_m: dict[str, float] = {}
            if kept:
                if stage.lr_decay_steps:
                    self.trainer.set_lr(stage_lr(stage, cfg.algorithm.lr, self.state.stage_step))
                if cfg.rollout.max_staleness == 0:  # the engines wait for this step: their
                    await self.rt.release_engine_caches()  # caches go before it starts
                try:
                    train_m = await trainer_step(self.stop, RL_GIVE_UP, self.trainer.train_step,
                                                 Batch(step=step, policy_version=version,
                                                       groups=kept))
                except StepAbandoned:  # the step never happened: its problems are sampled
                    self.state.global_step = step - 1  # again on resume, RoC draws again
                    self.rng.setstate(rng_before)
                    prod.give_back(wave)
                    raise
            timing = {"timing/update_s": time.monotonic() - t0,
                      "timing/sync_s": await self._sync() if kept else 0.0}
            self.state.stage_step += 1
            prod.step_done()  # the next wave(s) may start: they sample the new version
            rolls = group_rollouts(wave.groups)
            timing["timing/step_s"] = time.monotonic() - t_step
            row = step_row(stage, step, self.state.policy_version, wave, rolls,
                           {**numeric(roc_m, "roc/"), **numeric(train_m), **async_m, **timing})
            self.metrics.write("rl_step", **row)
            self.progress.step(self.state.stage_step, step, reward=row["reward/mean"])
            keep_every = cfg.logging.rollouts_every
            if keep_every and step % keep_every == 0:  # the whole wave, RoC's marks included
                await asyncio.to_thread(save_jsonl, self.rt.run_dir / "rollouts" /
                                        f"step_{step:06d}.jsonl", wave.groups)
            log.info("rl_step", reward=round(row["reward/mean"], 3),
                     tool_err_pos=round(row.get("rollout/tool_error_ratio_pos", 0.0), 3),
                     kept_groups=len(kept), seconds=round(timing["timing/step_s"], 2),
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
        greedy answer (`asyncrl.observe.evaluation.with_greedy`); every rollout of both is kept under
        `eval/` (`{step}-{label}.jsonl`, the greedy pass's `{step}-{label}-greedy.jsonl`)."""
        probs = self.eval_problems
        if not probs:
            return {}
        ev = self.cfg.eval
        probs = held_out_cut(probs, ev.max_problems)
        t0 = time.monotonic()
        temp = eval_temperature(self.cfg)
        key = f"eval:{self.state.global_step}:{label}"
        out = self.rt.run_dir / "eval" / f"{self.state.global_step:06d}-{label}"
        # a stop during a long evaluation keeps its finished groups for the resumed run
        who = {"policy_version": self.state.policy_version,
               "task": msgspec.to_builtins(self.cfg.task), "system": self.rt.runner.system_prompt}
        sampled = self._settings(stage, eval_=True, seed_key=key)
        passes = [GroupJournal.for_pass(out.with_suffix(".jsonl"), ev.k, sampled, probs, **who)]
        groups = await self._rollouts(probs, ev.k, sampled, journal=passes[0])
        summary = summarize(groups, ev.k)
        await asyncio.to_thread(save_jsonl, out.with_suffix(".jsonl"), groups)
        if ev.greedy and temp > 0:
            plain = self._settings(stage, eval_=True, seed_key=key + ":greedy", temperature=0.0)
            greedy_out = out.with_name(out.name + "-greedy.jsonl")
            passes.append(GroupJournal.for_pass(greedy_out, 1, plain, probs, **who))
            greedy = await self._rollouts(probs, 1, plain, journal=passes[-1])
            summary = with_greedy(summary, summarize(greedy, 1))
            await asyncio.to_thread(save_jsonl, greedy_out, greedy)
        summary["temperature"] = temp
        m = {f"eval/{k}": v for k, v in summary.items()}
        self.metrics.write("eval", label=label, stage=stage.name if stage else "",
                           step=self.state.global_step, seconds=time.monotonic() - t0, **m)
        for j in passes:  # after the row: a kill before it leaves them for the rerun
            j.remove()
        self.progress.evaluated(self.state.global_step, m["eval/accuracy"])
        log.info("eval", label=label, accuracy=round(m["eval/accuracy"], 4), problems=len(probs))
        return m

    async def _checkpoint(self, force: bool = False) -> None:
        """Write a checkpoint in a worker thread: rollouts of the next steps may be in flight
        (the producer's waves), and weights, optimizer state and fsyncs would stall them.
        Nothing else touches the trainer until this returns (the step awaits it)."""
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
        sft = self.cfg.stages[min(st.stage_index, len(self.cfg.stages) - 1)].kind != "rl"
        # the RL step does not move during SFT (or distill): their checkpoints have own names
        name = f"sft_{st.stage_index:02d}_{st.stage_step:08d}" if sft else None
        await asyncio.to_thread(save_checkpoint, self.rt.run_dir, st.global_step,
                                self.trainer, msgspec.to_builtins(st),
                                keep_last=self.cfg.checkpoint.keep_last, name=name,
                                order=(st.global_step, st.stage_index, st.stage_step))


def step_row(stage: StageSection, step: int, policy_version: int, wave: Wave,
             rolls: list[Rollout], extra: dict[str, float]) -> dict[str, Any]:
    """An RL step's `metrics.jsonl` row: the wave's rollout statistics (reward, accuracy,
    tool use and errors, lengths), `extra` (RoC, trainer, async and timing figures), the
    wave's rollout time and tool wait, and the problem ids it trained on."""
    stats = rollout_stats(rolls)
    reward = stats.get("rollout/reward_mean", 0.0)
    return {
        "stage": stage.name, "step": step, "policy_version": policy_version,
        "problem_ids": [p.id for p in wave.problems],
        "reward/mean": reward, "train/accuracy": reward, **stats, **extra,
        "timing/rollout_s": (wave.finished or time.monotonic()) - wave.started,
        "timing/tool_wait_s": sum(r.timing.tool_wait_s for r in rolls),
    }


# ------------------------------------------------------------------------------- entry points
def stop_summary(run_dir: Path, resume_command: str = "") -> str:
    """What a stopped run has on disk, in a sentence: its newest checkpoint and how to go on."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return "No checkpoint yet: a new run starts from the beginning."
    return (f"Newest checkpoint: {ckpt}." + (f" Resume with: {resume_command}"
                                            if resume_command else ""))


def _filtered(rt: Runtime, tools: list[dict[str, Any]] | None,
              system: str) -> tuple[LoadResult, LoadResult | None]:
    """The runtime's task's splits (loaded once when it opened) less the prompts longer than
    `data.max_prompt_tokens`."""
    d, task = rt.cfg.data, rt.task

    def one(spec: str, split: str, problems: list[Problem]) -> LoadResult:
        loaded = LoadResult(problems, dict(task.skipped.get(split, {})))
        return filter_split(loaded, spec, split, rt.tokenizer, rt.fmt, tools,
                            d.max_prompt_tokens, system)

    return (one(d.train, "train", task.problems),
            one(d.eval, "eval", task.held_out) if d.eval else None)


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
            e.checkpoint = latest_checkpoint(rd)
            log.warning("run_stopped", signal=e.signal_name, where=e.where,
                        checkpoint=str(e.checkpoint), seconds=round(
                            time.monotonic() - (stop.at or time.monotonic()), 2))
            raise


async def _train(cfg: RunConfig, resume: bool, rd: Path, stop: StopRequest) -> Path:
    await asyncio.to_thread(rd.mkdir, parents=True, exist_ok=True)
    logmod.configure(cfg.logging.level, cfg.logging.console, run_dir=rd)
    logmod.bind_contextvars(run=rd.name)
    config_mod.write_resolved(cfg, rd)
    log.info("run_start", run_dir=str(rd), resume=resume)
    t_start = time.monotonic()
    state = TrainState()
    progress = RunProgress(rd.name, StagePlan.of(cfg))
    ckpt = None
    async with open_runtime(cfg, rd) as rt:
        if resume:  # newest readable first, each unreadable one loudly; none readable: refused
            found = await asyncio.to_thread(load_newest, rd, rt.need_trainer(),
                                            lambda d: msgspec.convert(d, TrainState))
            if found is None:
                log.warning("resume_without_checkpoint", run_dir=str(rd),
                            hint="no checkpoint yet: the run starts from the beginning")
            else:
                ckpt, state = found
        # an evaluation's journal is kept only for the one a stop interrupted (the checkpoint
        # holds its weights); a kill's rerun may reach that step on other weights
        last = bool(cfg.stages) and (state.stage_index >= len(cfg.stages) or (
            state.stage_index == len(cfg.stages) - 1
            and state.stage_step >= cfg.stages[-1].steps))
        keep = f"{state.global_step:06d}-" if ckpt and (state.eval_due or last) else ""
        await asyncio.to_thread(discard, rd / "eval", keep)
        if ckpt is not None:
            await _push_weights(rt, state.policy_version)
            log.info("resumed", checkpoint=str(ckpt), step=state.global_step,
                     stage=cfg.stages[min(state.stage_index, len(cfg.stages) - 1)].name)
        instrument(rt.runner, progress)
        tools = [t.schema for t in rt.tools] or None
        system = rt.runner.system_prompt  # data.system_prompt, or the task source's
        train, evals = _filtered(rt, tools, system)
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
        # a complete HF directory for every tool, a LoRA run's merged/ and base/ included
        modeling.save_tokenizer_everywhere(rt.tokenizer, rd / "final")
    report = write_report(rd)
    log.info("run_done", run_dir=str(rd), report=str(report),
             viewer=str(report.parent / "viewer.html"),
             wall_s=round(time.monotonic() - t_start, 1))
    return rd


async def _push_weights(rt: Runtime, version: int) -> None:
    """New weights to every engine, the way `engine.weight_sync` says (each engine kind has
    its own default): `asyncrl.weightsync.push.push_weights`."""
    await push_weights(rt.engines, rt.need_trainer(), version, rt.cfg.engine.weight_sync,
                       Path(rt.run_dir), group=rt.weight_group)
