"""A distill stage: a cold start from the rollouts a model gets right (rejection-sampling SFT).

For a task source with a reward and no solution programs, no transcript can be written for
it; but a model that sometimes solves a problem with the tool can be shown its own successes.
Each round samples `samples_per_problem` rollouts per problem from the policy (or a teacher,
`[stages.distill.teacher]`, through any engine kind), keeps those the task's reward accepts,
deduplicated by the model's own tokens and capped per problem over all rounds, and takes its
share of the stage's optimizer steps on every transcript kept so far.

A kept rollout is trained token for token as it was sampled: its prompt and response ids, the
model's tokens trained (`Rollout.loss_mask` 1) and the tool outputs and prompt as context
(mask 0), exactly the sequence an RL update would see (`asyncrl.algo.batching`); nothing is
re-rendered through a template.

Owns: the selection (`Pool`, `Verdict`: pure, tested without an event loop), the round and
step plan (`round_ends`, `round_order`), the stage loop (`run_distill`: sample, select, save
the round's groups under `RUN_DIR/distill/`, train, sync between rounds; resumable from
`TrainState.sft_cursor` and those files) and a teacher's engines (`open_teacher`). Does not
own: sampling (the caller's `sample`, the run's rollout runner), the weight sync, evaluation
or checkpoint I/O (the train loop).

A stage that keeps no transcript in any round is an error (`DataError`): there is nothing
to train, and going on to RL from the untrained model would hide it. Rounds before a first
kept transcript train nothing; their steps are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

from asyncrl.algo.schedule import stage_lr
from asyncrl.config import DistillSection, StageSection, TeacherSection
from asyncrl.errors import ConfigError, DataError
from asyncrl.log import get_logger
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.records import Group, Problem, Rollout, RolloutStatus, read_jsonl, save_jsonl
from asyncrl.sft.stage import DEFAULT_BATCH, Pair, SFTSetup, SFTState, step_row
from asyncrl.stopping import SFT_GIVE_UP, StopRequest, trainer_step

log = get_logger(__name__)


class Verdict(enum.StrEnum):
    """What the selection made of one sampled rollout."""

    KEPT = "kept"
    WRONG = "wrong"
    """The task's reward did not accept it (`Rollout.is_correct` false)."""
    UNFINISHED = "unfinished"
    """Accepted, but it did not end on its own (budget, turn limit, failure): its tokens do
    not end the answer, and training on them would teach the model not to stop."""
    DUPLICATE = "duplicate"
    """The same model tokens as a transcript already kept for the problem."""
    OVER_CAP = "over_cap"
    """The problem already has `max_per_problem` kept transcripts."""


REJECTED = (Verdict.WRONG, Verdict.UNFINISHED, Verdict.DUPLICATE, Verdict.OVER_CAP)


def response_key(rollout: Rollout) -> tuple[int, ...]:
    """What two rollouts must share to be duplicates: the model's own tokens, turn by turn
    (-1 between turns). Tool outputs are left out: the same program run twice may print a
    different time, and it is the model's behaviour that one transcript teaches."""
    key: list[int] = []
    prev = 0
    for t, m in zip(rollout.response_ids, rollout.loss_mask, strict=True):
        if m:
            key.append(t)
        elif prev:
            key.append(-1)
        prev = m
    return tuple(key)


def transcript(rollout: Rollout) -> Pair:
    """A kept rollout as an SFT example: (prompt + response ids, 0 over the prompt then the
    rollout's own loss mask), the sequence the RL update trains (`batching.sequences_from_batch`)."""
    rollout.check()
    return (list(rollout.prompt_ids) + list(rollout.response_ids),
            [0] * len(rollout.prompt_ids) + [int(m) for m in rollout.loss_mask])


class Pool:
    """The transcripts kept so far, in the order they were kept, at most `cap` per problem,
    no two of a problem with the same `response_key`."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept: list[Rollout] = []
        self._keys: dict[str, set[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self.kept)

    def count(self, problem_id: str) -> int:
        return len(self._keys.get(problem_id, ()))

    def full(self, problem_id: str) -> bool:
        return self.count(problem_id) >= self.cap

    def offer(self, problem_id: str, rollout: Rollout) -> Verdict:
        """Keep `rollout` if the reward accepted it, it finished, it is new and the problem
        is below the cap; the reason otherwise (checked in that order)."""
        if not rollout.is_correct:
            return Verdict.WRONG
        if rollout.status != RolloutStatus.COMPLETED:
            return Verdict.UNFINISHED
        key = response_key(rollout)
        seen = self._keys.setdefault(problem_id, set())
        if key in seen:
            return Verdict.DUPLICATE
        if len(seen) >= self.cap:
            return Verdict.OVER_CAP
        seen.add(key)
        self.kept.append(rollout)
        return Verdict.KEPT

    def select(self, groups: Sequence[Group]) -> dict[Verdict, int]:
        """Offer every rollout of `groups` (in order); marks each group's `kept` indices (so
        a saved group says which of its rollouts were kept) and counts the verdicts."""
        counts = dict.fromkeys(Verdict, 0)
        for g in groups:
            g.kept = []
            for i, r in enumerate(g.rollouts):
                v = self.offer(g.problem.id, r)
                counts[v] += 1
                if v is Verdict.KEPT:
                    g.kept.append(i)
        return counts

    def restore(self, groups: Sequence[Group]) -> None:
        """Take back the kept rollouts of saved groups (a resumed stage), in their order."""
        for g in groups:
            for i in g.kept:
                self.offer(g.problem.id, g.rollouts[i])


def round_ends(steps: int, rounds: int) -> list[int]:
    """The stage step at which each round's training ends: `steps` split as evenly as it
    goes, the earlier rounds taking the remainder (steps >= rounds: the config says so)."""
    q, r = divmod(steps, rounds)
    ends, at = [], 0
    for i in range(rounds):
        at += q + (1 if i < r else 0)
        ends.append(at)
    return ends


def round_order(n: int, seed: int, round_index: int) -> list[int]:
    """The order a round trains the pool's `n` transcripts in (cycled), seeded."""
    order = list(range(n))
    random.Random(f"asyncrl.sft.distill:{seed}:{round_index}").shuffle(order)
    return order


def round_problems(problems: Sequence[Problem], pool: Pool, per_round: int, seed: int,
                   round_index: int) -> list[Problem]:
    """A round's problems: those below the cap, a seeded subset of `per_round` (0 = all)."""
    open_ = [p for p in problems if not pool.full(p.id)]
    if per_round and per_round < len(open_):
        open_ = random.Random(f"asyncrl.sft.distill.problems:{seed}:{round_index}").sample(
            open_, per_round)
    return open_


Sample = Callable[[list[Problem], int, int], Awaitable[list[Group]]]
"""`sample(problems, samples_per_problem, round_index) -> groups`, rewarded."""


def _round_file(out_dir: Path, r: int) -> Path:
    return out_dir / f"round_{r:02d}.jsonl"


async def run_distill(stage: StageSection, setup: SFTSetup, state: SFTState,
                      metrics: MetricsWriter, problems: Sequence[Problem], sample: Sample,
                      sync: Callable[[], Awaitable[Any]] | None, out_dir: Path,
                      checkpoint: Callable[[], Awaitable[None]],
                      on_step: Callable[[float | None], None] | None = None,
                      stop: StopRequest | None = None) -> None:
    """Run the distill `stage` from `state.stage_step` to `stage.steps` (see the module).

    Each round's groups go to `out_dir/round_NN.jsonl` with `kept` marking the kept
    rollouts; `state.sft_cursor` = `{"round": r}` once round r is sampled. A resumed stage
    rebuilds the pool from the files of rounds up to the cursor's and samples the next.
    `sync` pushes the trained weights to the sampling engines before each round after the
    first (None: they do not change, a teacher).
    Writes one `distill_round` row per round (kept and rejected counts, per reason) and
    `sft_step` rows as an SFT stage does."""
    cfg = stage.distill or DistillSection()
    ends = round_ends(stage.steps, cfg.rounds)
    bs = stage.batch_size or DEFAULT_BATCH
    pool = Pool(cfg.max_per_problem)
    sampled = int(state.sft_cursor["round"]) if "round" in state.sft_cursor else -1
    for r in range(sampled + 1):
        await asyncio.to_thread(_restore, pool, _round_file(out_dir, r))
    first = next((i for i, e in enumerate(ends) if state.stage_step < e), cfg.rounds)
    first = min(first, sampled + 1) if sampled >= 0 else first
    for r in range(first, cfg.rounds):
        if r > sampled:
            if stop is not None:
                stop.check()
            if r > 0 and sync is not None:  # it samples the policy as the last round left it
                await sync()
            await _sample_round(stage, cfg, setup.seed, state, metrics, problems, sample, pool,
                                r, out_dir)
            state.sft_cursor = {"round": r}
        if not pool.kept:
            if r == cfg.rounds - 1:
                raise DataError(
                    f"stage {stage.name!r}: no sampled rollout was accepted by the task's "
                    f"reward in {cfg.rounds} round(s) of {cfg.samples_per_problem} samples "
                    "per problem, so there is nothing to train on; sample more "
                    "(stages.distill.samples_per_problem, rounds), use a stronger model "
                    "(stages.distill.teacher), or cold start from solutions or chat files")
            state.stage_step = ends[r]  # nothing to train on yet: this round's steps lapse
            continue
        await _train_round(stage, setup, state, metrics, pool, r, ends[r], bs, checkpoint,
                           on_step, stop)


def _restore(pool: Pool, path: Path) -> None:
    if not path.exists():
        raise DataError(f"a resumed distill stage needs its sampled round {path} "
                        "(written when the round was sampled): resume in the same run directory")
    pool.restore(read_jsonl(path, Group))


async def _sample_round(stage: StageSection, cfg: DistillSection, seed: int, state: SFTState,
                        metrics: MetricsWriter, problems: Sequence[Problem], sample: Sample,
                        pool: Pool, r: int, out_dir: Path) -> None:
    probs = round_problems(problems, pool, cfg.problems_per_round, seed, r)
    groups = await sample(probs, cfg.samples_per_problem, r) if probs else []
    counts = pool.select(groups)
    await asyncio.to_thread(save_jsonl, _round_file(out_dir, r), groups)
    sampled = sum(len(g.rollouts) for g in groups)
    rejected = sum(counts[v] for v in REJECTED)
    metrics.write("distill_round", stage=stage.name, step=state.global_step, round=r + 1,
                  problems=len(probs), sampled=sampled, kept=counts[Verdict.KEPT],
                  rejected=rejected, **{f"rejected_{v}": counts[v] for v in REJECTED},
                  pool=len(pool), problems_with_kept=sum(pool.count(p.id) > 0
                                                         for p in problems))
    log.info("distill_round", round=r + 1, problems=len(probs), sampled=sampled,
             kept=counts[Verdict.KEPT], rejected=rejected, pool=len(pool))


async def _train_round(stage: StageSection, setup: SFTSetup, state: SFTState,
                       metrics: MetricsWriter, pool: Pool, r: int, end: int, bs: int,
                       checkpoint: Callable[[], Awaitable[None]],
                       on_step: Callable[[float | None], None] | None,
                       stop: StopRequest | None) -> None:
    """The round's optimizer steps (up to stage step `end`) over the whole pool, cycled in a
    seeded order; batch i of the round is a function of (seed, round, i): a resumed round
    takes the batches the stopped one would have."""
    pairs = [transcript(x) for x in pool.kept]
    order = round_order(len(pairs), setup.seed, r)
    begin = _round_begin(stage, r)
    trainer = setup.trainer
    while state.stage_step < end:
        if stop is not None:
            stop.check()
        if stage.lr_decay_steps:
            trainer.set_lr(stage_lr(stage, setup.lr, state.stage_step))
        i = (state.stage_step - begin) * bs
        batch = [pairs[order[(i + j) % len(pairs)]] for j in range(bs)]
        m = await trainer_step(stop, SFT_GIVE_UP, trainer.sft_step, batch)
        state.stage_step += 1
        if on_step is not None:
            on_step(m.get("sft/loss"))
        last = state.stage_step == stage.steps
        row = step_row(state, m, state.stage_step % 10 == 0 or state.stage_step == end)
        if row is not None:
            metrics.write("sft_step", stage=stage.name, step=state.global_step,
                          sft_step=state.stage_step, round=r + 1, **row)
            log.info("sft_step", step=state.stage_step, loss=round(row["sft/loss"], 4))
        ckpt = setup.checkpoint_every
        if not last and ckpt and state.stage_step % ckpt == 0:
            await checkpoint()


def _round_begin(stage: StageSection, r: int) -> int:
    cfg = stage.distill or DistillSection()
    return [0, *round_ends(stage.steps, cfg.rounds)][r]


# ------------------------------------------------------------------------------- teacher
@contextlib.asynccontextmanager
async def open_teacher(teacher: TeacherSection, key: str, tokenizer: Any, dtype: str,
                       run_dir: Path) -> AsyncIterator[list[Any]]:
    """The teacher's engines, started, for the length of a stage; closed after it (also on
    error). `key` is the teacher section's dotted path, for errors. Its tokenizer must have
    the policy's vocabulary (the transcripts are trained token for token)."""
    from asyncrl import modeling
    from asyncrl.engine.registry import build_engines

    try:
        own = await asyncio.to_thread(modeling.load_tokenizer, teacher.path)
    except Exception as exc:  # any failure to read it: the path is what the user can fix
        raise ConfigError(f"{key}.path", f"cannot load the teacher's tokenizer from "
                          f"{teacher.path!r}: {exc}") from None
    if own.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{key}.path", f"the teacher's tokenizer ({len(own)} tokens) is not "
                          f"the policy's ({len(tokenizer)}): a distilled transcript is trained "
                          "token for token, so the teacher must share the policy's vocabulary")
    model = None
    if teacher.engine.kind == "local":
        model = (await asyncio.to_thread(modeling.load_model, teacher.path, dtype)).eval()
    engines = build_engines(teacher.engine, model=model, tokenizer=tokenizer,
                            run_dir=run_dir / "teacher", model_path=teacher.path,
                            name="teacher-0")
    async with contextlib.AsyncExitStack() as stack:
        for e in engines:
            if hasattr(e, "__aenter__"):
                await stack.enter_async_context(
                    cast(contextlib.AbstractAsyncContextManager[Any], e))
            else:
                stack.push_async_callback(e.close)
        log.info("teacher_ready", path=teacher.path, engines=[e.name for e in engines])
        yield engines
