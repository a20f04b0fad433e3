"""An SFT stage: its examples, their order into optimizer steps, the steps, the held-out loss.

A plain component: `run_sft` takes the trainer, tokenizer and format and the values of its own
config sections (`SFTSetup`), never the run's root config or runtime.

Owns: `SFTPlan` (pure: per-epoch seeded order of examples into batches under a row and token
budget, optionally bucketed by length, with a resumable (epoch, index) cursor), and `run_sft`, the stage
itself over the run's trainer: examples from the generator (`asyncrl.sft.coldstart`, the tiny curriculum)
or from chat files (`[stages.chat]`, `asyncrl.sft.chat`), one `trainer.sft_step` per batch,
metrics, checkpoints every `checkpoint.sft_every_steps` stage steps, a stop between steps, and the held-out loss
(`trainer.sft_eval`). Does not own: the stage order, evaluation by rollouts, or checkpoint I/O
(the train loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from asyncrl.algo.schedule import stage_lr
from asyncrl.config import StageSection
from asyncrl.errors import DataError, StepAbandoned
from asyncrl.formats import ToolFormat
from asyncrl.log import get_logger
from asyncrl.observe.metrics import MetricsWriter, numeric
from asyncrl.records import Problem
from asyncrl.stopping import SFT_GIVE_UP, StopRequest, trainer_step
from asyncrl.tasks.stream import ProblemStream
from asyncrl.tasks.task import SolutionCode

if TYPE_CHECKING:
    from asyncrl.rollout.tools import Tool
    from asyncrl.trainer.base import Trainer

log = get_logger(__name__)

DEFAULT_BATCH = 16


class SFTState(Protocol):
    """Where the run is, as an SFT stage reads and advances it (`asyncrl.stages.TrainState`)."""

    stage_step: int
    global_step: int
    sft_cursor: dict[str, Any]
    sft_loss_window: list[float]


def step_row(state: SFTState, m: dict[str, float], due: bool) -> dict[str, float] | None:
    """Adds step `m` (a trainer's `sft_step` metrics) to the loss window in `state`; when `due`
    (an `sft_step` row is written), the row's metrics, with the window emptied: the step's own,
    but `sft/loss` the token-weighted mean over every step since the last row (a curve of
    single batches is mostly batch-to-batch noise), `sft/step_loss` the step's own and
    `sft/loss_steps` how many steps the mean covers. The window lives in the run's state, so a
    resumed run writes the rows an unstopped one would."""
    loss, tokens = m.get("sft/loss", 0.0), m.get("sft/tokens", 0.0)
    w = state.sft_loss_window or [0.0, 0.0, 0.0]
    w = [w[0] + loss * tokens, w[1] + tokens, w[2] + 1]
    if not due:
        state.sft_loss_window = w
        return None
    state.sft_loss_window = []
    row = numeric(m)
    row["sft/step_loss"] = loss
    row["sft/loss"] = w[0] / w[1] if w[1] else loss
    row["sft/loss_steps"] = w[2]
    return row


_BUCKET_BATCHES = 32
"""Length buckets span this many batches' worth of rows (sorted within, batches shuffled)."""


class SFTPlan:
    """Batches of example indices, epoch after epoch; `cursor` says where the next one is.

    Epoch `e`'s batches depend only on (seed, e, lengths): rows are shuffled and cut, in that
    order, into batches of at most `batch_size` rows and `batch_tokens` tokens (0 = no limit;
    a row longer than the budget is a batch alone). With `bucket`, rows are first sorted by
    length inside windows of `_BUCKET_BATCHES` batches (similar lengths share a batch: less
    padding) and the batches are then shuffled. With `shuffle` off, file order.
    """

    def __init__(self, lengths: Sequence[int], seed: int, batch_size: int = 0,
                 batch_tokens: int = 0, shuffle: bool = True,
                 cursor: dict[str, Any] | None = None, bucket: bool = False) -> None:
        if not lengths:
            raise DataError("an SFT stage needs at least one example")
        self.lengths = list(lengths)
        self.seed = seed
        self.batch_size = batch_size or (0 if batch_tokens else DEFAULT_BATCH)
        self.batch_tokens = batch_tokens
        self.shuffle = shuffle
        self.bucket = bucket and shuffle
        self.fingerprint = hashlib.sha256(repr(self.lengths).encode()).hexdigest()[:16]
        self.epoch, self.index = 0, 0
        if cursor:
            if cursor.get("fingerprint") != self.fingerprint:
                raise DataError("the SFT examples differ from the checkpoint's: resume with "
                                "the same data files and tokenizer")
            self.epoch, self.index = int(cursor["epoch"]), int(cursor["index"])
        self._batches = self.epoch_batches(self.epoch)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(f"asyncrl.sft.coldstart:{self.seed}:{epoch}")
        if self.shuffle:
            rng.shuffle(order)
        per = self.batch_size or max(1, len(order) // 64)
        window = per * _BUCKET_BATCHES if self.bucket else len(order)
        batches: list[list[int]] = []
        for w in range(0, len(order), window):
            part = order[w:w + window]
            if self.bucket:
                part.sort(key=lambda i: self.lengths[i])
            cur: list[int] = []
            tokens = 0
            for i in part:
                n = self.lengths[i]
                full = (self.batch_size and len(cur) >= self.batch_size) or (
                    self.batch_tokens and tokens + n > self.batch_tokens)
                if cur and full:
                    batches.append(cur)
                    cur, tokens = [], 0
                cur.append(i)
                tokens += n
            if cur:
                batches.append(cur)
        if self.bucket:
            rng.shuffle(batches)
        return batches

    def next_batch(self) -> list[int]:
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self.epoch_batches(self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return batch

    def cursor(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "fingerprint": self.fingerprint}


Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class SFTSetup:
    """What an SFT stage takes from the run: the trainer, the tokenizer and tool format the
    examples are rendered with, and the values of its config sections it reads."""

    trainer: Trainer
    tokenizer: Any
    fmt: ToolFormat
    tools: list[dict[str, Any]] | None
    """Tool schemas shown in the rendered prompt (None: no tools)."""
    system_prompt: str
    """`data.system_prompt`."""
    seed: int
    """`run.seed`."""
    lr: float
    """`algorithm.lr` (the stage's own schedule scales it)."""
    tool_output_max_chars: int
    """`rollout.tool_output_max_chars`: generated tool outputs are cut as rollouts' are."""
    checkpoint_every: int
    """`checkpoint.sft_every_steps` (0: only at the stage's end, by the caller)."""
    show_tool_time: bool = True
    """`rollout.tool_time` resolved: generated tool outputs show a time as rollouts' do."""
    python_tool: Tool | None = None
    """The run's Python tool: runs the generated programs of a stage with `sandbox_outputs`."""
    shuffle: bool = True
    """`data.shuffle`: a generated cold start draws its problems in seeded permutations
    (`draw_problems`), else in list order."""
    solution_code: SolutionCode | None = None
    """The task's worked solutions (`Task.solution_code`): what generated transcripts say and
    run; None: the task supplies none, and only chat-file stages can train on it."""


class Generated(NamedTuple):
    """A generator stage's examples (generation order) and what became of its problems."""

    pairs: list[Pair]
    drawn: int
    """Transcripts asked for (`stage.examples`, else steps * batch size)."""
    no_solution: int
    """Of those, problems drawn a tool transcript that the task has no worked solution for:
    left out."""


def draw_problems(problems: Sequence[Problem], n: int, seed: int,
                  shuffle: bool = True) -> list[Problem]:
    """The `n` problems a generated cold start renders: pass after pass over `problems`, each
    pass a permutation that depends only on (`seed`, pass), or in list order when `shuffle` is
    off. A source lists its problems grouped (reasoning-gym by generator, a file by topic): the
    first `n` of them in order would teach the first group only. Not RL's order (another
    salt): the cold start does not pre-train the prompts RL meets first."""
    if not problems:
        raise DataError("the cold start has no training problems to render")
    return ProblemStream(problems, seed, shuffle, salt="asyncrl.sft").next_batch(n)


async def sandboxed_pairs(stage: StageSection, setup: SFTSetup,
                          problems: Sequence[Problem]) -> Generated:
    """`generator_pairs` with every program's output from the run's sandbox
    (`stage.sandbox_outputs`): one pass records the programs, the sandbox runs each once, a
    second pass over the same draws renders its outputs."""
    from asyncrl.sft.coldstart import SandboxOutputs

    if setup.python_tool is None:
        raise DataError(f"stage {stage.name!r}: sandbox_outputs needs the Python tool "
                        "(rollout.tools)")
    outputs = SandboxOutputs()
    generator_pairs(stage, setup, problems, execute=outputs.record)
    await outputs.run(setup.python_tool)
    log.info("sft_sandbox_outputs", programs=len(outputs.programs))
    return generator_pairs(stage, setup, problems, execute=outputs.replay)


def generator_pairs(stage: StageSection, setup: SFTSetup,
                    problems: Sequence[Problem], execute: Any = None) -> Generated:
    """Generated transcripts (`asyncrl.sft.coldstart`) of the task's problems with its worked
    solutions (`setup.solution_code`), in generation order, in the stage's `transcript_style`;
    `execute` runs their programs (default: in process, `coldstart.run_trusted`). A problem
    drawn a tool transcript that has no worked solution is left out and counted; a stage left
    with no tool transcript while it asks for some is a `DataError`."""
    from asyncrl.sft.coldstart import build_sft_examples

    wants_tool = stage.tool_fraction + sum(stage.tool_fraction_by_level.values()) > 0
    if setup.solution_code is None and wants_tool:
        raise DataError(f"stage {stage.name!r}: the task source supplies no solution programs "
                        "(TaskSource.solution_code), so no transcript can call the tool; give "
                        "it solutions, set tool_fraction = 0, or train on chat files")
    n = stage.examples or stage.steps * (stage.batch_size or DEFAULT_BATCH)
    probs = draw_problems(problems, n, setup.seed, setup.shuffle)
    examples = build_sft_examples(
        probs, setup.fmt, setup.tokenizer, random.Random(setup.seed),
        tool_fraction=stage.tool_fraction, fail_fix_fraction=stage.fail_fix_fraction,
        fail_fix_by_level={int(k): v for k, v in stage.fail_fix_by_level.items()},
        tool_fraction_by_level={int(k): v for k, v in stage.tool_fraction_by_level.items()},
        tools=setup.tools, system_prompt=setup.system_prompt,
        max_chars=setup.tool_output_max_chars, style=stage.transcript_style,
        execute=execute, code_for=setup.solution_code, show_time=setup.show_tool_time)
    if wants_tool and not any(e.kind != "direct" for e in examples):
        raise DataError(f"stage {stage.name!r}: the task source has a worked solution for none "
                        f"of the {len(problems)} training problems, so no transcript can call "
                        "the tool; set tool_fraction = 0 or train on chat files")
    if not examples:
        raise DataError(f"stage {stage.name!r}: no transcript was generated")
    return Generated([(e.input_ids, e.loss_mask) for e in examples], n, n - len(examples))


async def run_sft(stage: StageSection, setup: SFTSetup, state: SFTState,
                  metrics: MetricsWriter, problems: Sequence[Problem],
                  checkpoint: Callable[[], Awaitable[None]],
                  on_step: Callable[[float | None], None] | None = None,
                  stop: StopRequest | None = None) -> None:
    """Run `stage` from `state.stage_step` to `stage.steps`. `state.sft_cursor` holds the chat
    path's cursor across checkpoints; the generator path's order is a function of the step.
    `on_step(loss)` runs after every step (the progress display). A `stop` request is honoured
    between steps and gives up a step under way (`RunStopped`: `state` then describes the last
    completed step; the caller saves it)."""
    trainer = setup.trainer
    valid: list[Pair] = []
    if stage.chat is None:
        made = (await sandboxed_pairs(stage, setup, problems) if stage.sandbox_outputs
                else generator_pairs(stage, setup, problems))
        pairs = made.pairs
        metrics.write("sft_data", stage=stage.name, step=state.global_step, rows=made.drawn,
                      train=len(pairs), no_solution=made.no_solution)
        log.info("sft_generated", transcripts=len(pairs), no_solution=made.no_solution)
        bs = stage.batch_size or DEFAULT_BATCH

        def next_batch() -> list[Pair]:
            i = state.stage_step * bs
            return [pairs[(i + j) % len(pairs)] for j in range(bs)]
    else:
        from asyncrl.sft.chat import load_chat

        c = stage.chat
        loaded = await asyncio.to_thread(
            load_chat, c.train, setup.fmt, setup.tokenizer, valid=c.valid,
            valid_fraction=c.valid_fraction, layout=c.layout, max_tokens=c.max_tokens,
            system_prompt=setup.system_prompt, seed=setup.seed,
            max_bad_fraction=c.max_bad_fraction)
        metrics.write("sft_data", stage=stage.name, step=state.global_step, rows=loaded.rows,
                      train=len(loaded.train), valid=len(loaded.valid), bad=loaded.num_bad,
                      **{f"bad/{k}": v for k, v in loaded.skipped.items()})
        examples = loaded.train
        valid = [e.pair() for e in loaded.valid]
        plan = SFTPlan([len(e) for e in examples], setup.seed, stage.batch_size,
                       c.batch_tokens, c.shuffle, cursor=state.sft_cursor or None,
                       bucket=c.bucket_by_length)

        def next_batch() -> list[Pair]:
            batch = [examples[i].pair() for i in plan.next_batch()]
            state.sft_cursor = plan.cursor()
            return batch

    every_valid = stage.chat.valid_every if stage.chat is not None else 0
    while state.stage_step < stage.steps:
        if stop is not None:
            stop.check()
        if stage.lr_decay_steps:
            trainer.set_lr(stage_lr(stage, setup.lr, state.stage_step))
        cursor = state.sft_cursor
        try:
            m = await trainer_step(stop, SFT_GIVE_UP, trainer.sft_step, next_batch())
        except StepAbandoned:
            state.sft_cursor = cursor  # the chat path's batch is taken again on resume
            raise
        state.stage_step += 1  # SFT steps do not advance `global_step` (the RL step count)
        if on_step is not None:
            on_step(m.get("sft/loss"))
        last = state.stage_step == stage.steps
        row = step_row(state, m, state.stage_step % 10 == 0 or last)
        if row is not None:
            metrics.write("sft_step", stage=stage.name, step=state.global_step,
                          sft_step=state.stage_step, **row)
            log.info("sft_step", step=state.stage_step, loss=round(row["sft/loss"], 4))
        if valid and ((every_valid and state.stage_step % every_valid == 0) or last):
            await held_out_loss(stage, trainer, valid, state, metrics)
        ckpt = setup.checkpoint_every
        if not last and ckpt and state.stage_step % ckpt == 0:
            await checkpoint()


async def held_out_loss(stage: StageSection, trainer: Any, valid: Sequence[Pair], state: Any,
                        metrics: Any) -> float:
    """Token-mean loss on the held-out examples (chunks of the stage's batch size)."""
    bs = stage.batch_size or DEFAULT_BATCH
    nll, tokens = 0.0, 0.0
    for i in range(0, len(valid), bs):
        m = await asyncio.to_thread(trainer.sft_eval, list(valid[i:i + bs]))
        n = m.get("sft/tokens", 0.0)
        nll += m.get("sft/loss", 0.0) * n
        tokens += n
    loss = nll / tokens if tokens else 0.0
    metrics.write("sft_valid", stage=stage.name, step=state.global_step,
                  sft_step=state.stage_step, **{"sft/valid_loss": loss,
                                                "sft/valid_tokens": tokens})
    log.info("sft_valid", step=state.stage_step, loss=round(loss, 4))
    return loss
