"""The rollout producer: keeps engines busy across RL steps under a staleness bound.

Owns: the *waves* of one RL stage (wave k = the rollouts of step k: `prompts_per_step`
problems and their refills, their groups) started ahead of the trainer as
`algo.staleness.waves_allowed` permits, the bounded buffer of finished groups (the finished
groups of waves not yet taken: at most `(max_staleness + 1) * (prompts_per_step + refill_max)`
groups), handing waves to the loop in order, the problems of waves under way (for
checkpoints), and cancelling everything when the stage ends.
Does not own: running a rollout (`runner`), the rule itself (`algo.staleness`, pure), RoC, the
update or weight sync (the loop): engines are updated in place while waves generate, so a
rollout's tokens may come from several versions (`Rollout.token_versions`).

Use (one producer per RL stage):

    async with RolloutProducer(run_wave, next_problems, prompts_per_step=P,
                               max_staleness=N, waves_total=steps_left) as prod:
        for each step:
            wave = await prod.take()     # wave k, all its groups finished
            ... RoC, update, weight sync ...
            prod.step_done()             # admits the next wave(s)

`run_wave(problems, version, wave_index, part)` yields the finished groups of a wave's
problems (`RolloutRunner.run` bound to the stage's settings): part 0 is the wave's own
problems, part j its j-th refill (its own seed key: a wave that holds one problem twice, as a
small stream's epochs may make it, still gives each copy its own group id and samples);
`next_problems(n)` draws the next problems from the data stream.

Refills (`rollout.refill_equal_reward`, DAPO's dynamic sampling): with `refill_max > 0` and an
`informative(group)` predicate, each finished group that can carry no GRPO signal (every sample
got one reward) makes its wave draw one more problem, up to `refill_max` extra problems a wave;
the extra problems join `wave.problems` (so a checkpoint lists them) and run beside the rest.
Which problems a wave draws is then a function of its groups' rewards, not of their timing:
every equal group draws exactly one, in stream order, and a wave's groups are handed over in
`wave.problems` order. A resumed wave draws its refills from the resumed problems first, so at
`max_staleness = 0` a seeded run resumes onto the same problems. Problems of waves
given back by `resume_problems` (a checkpoint's waves that were under way) are issued first,
`prompts_per_step` per wave, in their order: resume regenerates in-flight work under the
restored weights, so no problem is skipped or trained twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from asyncrl.algo.staleness import waves_allowed
from asyncrl.log import get_logger
from asyncrl.records import Group, Problem, in_problem_order

log = get_logger(__name__)

RunWave = Callable[[list[Problem], int, int, int], AsyncIterator[Group]]
"""`run_wave(problems, policy_version, wave_index, part)`: the finished groups of those problems
of one wave, as they finish (part 0: the wave's own; part j: its j-th refill)."""


@dataclass
class Wave:
    """One step's rollouts."""

    index: int
    problems: list[Problem]
    started: float
    """`time.monotonic()` when it was started."""
    started_version: int
    groups: list[Group] = field(default_factory=list)
    """Finished groups (the bounded buffer's share of this wave): in completion order while
    the wave runs, in `problems` order once `take` hands it over."""
    task: asyncio.Task[None] | None = None
    finished: float = 0.0
    refilled: int = 0
    """Problems drawn to replace groups with no signal (`refill_max`), part of `problems`."""


class RolloutProducer:
    """Starts waves ahead of the trainer, at most `max_staleness + 1` at a time (see the
    module docstring). `version()` returns the engines' current policy version (recorded on
    each wave; the tokens carry their own)."""

    def __init__(self, run_wave: RunWave, next_problems: Callable[[int], list[Problem]], *,
                 prompts_per_step: int, max_staleness: int, waves_total: int,
                 version: Callable[[], int], resume_problems: Sequence[Problem] = (),
                 refill_max: int = 0, informative: Callable[[Group], bool] | None = None,
                 ) -> None:
        if prompts_per_step < 1:
            raise ValueError("prompts_per_step must be >= 1")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if refill_max < 0 or (refill_max and informative is None):
            raise ValueError("refill_max must be >= 0, and a refill needs `informative`")
        self.refill_max = refill_max
        self._informative = informative
        self._run_wave = run_wave
        self._next_problems = next_problems
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.waves_total = waves_total
        self._version = version
        self._resume = list(resume_problems)
        self._given_back: list[Problem] = []
        self._waves: dict[int, Wave] = {}
        self._started = 0
        self._taken = 0
        self.steps_done = 0
        self._closed = False

    async def __aenter__(self) -> RolloutProducer:
        self._admit()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------------------- loop API
    async def take(self) -> Wave:
        """Wave `k` (the next one in order) once all its groups have finished."""
        if self._taken >= self.waves_total:
            raise RuntimeError("every wave of this stage has been taken")
        k = self._taken
        if k not in self._waves:  # the loop took a wave before finishing the previous step
            raise RuntimeError(f"wave {k} was not admitted (call step_done after each step)")
        wave = self._waves[k]
        assert wave.task is not None
        await wave.task  # a runner bug surfaces here
        del self._waves[k]
        self._taken += 1
        wave.groups = in_problem_order(wave.groups, wave.problems)
        return wave

    def step_done(self) -> None:
        """The step of the last wave taken has finished (update pushed to the engines)."""
        self.steps_done += 1
        self._admit()

    def give_back(self, wave: Wave) -> None:
        """The step of `wave`, the last taken, was given up (a stop, `StepAbandoned`): its
        problems count as pending again, ahead of the waves started after it."""
        self._given_back = list(wave.problems)

    def pending_problems(self) -> list[Problem]:
        """Problems of waves started and not yet taken, in wave order, after those of a wave
        given back (for a checkpoint: a resumed run regenerates them first)."""
        started = [p for k in sorted(self._waves) for p in self._waves[k].problems]
        # resumed problems not re-issued yet come last
        return self._given_back + started + self._resume

    def stats(self) -> dict[str, float]:
        """`async/waves_in_flight` (started, not taken), `async/buffered_groups` (finished
        groups of those waves), `async/buffer_capacity` (the bound on both)."""
        return {
            "async/waves_in_flight": float(len(self._waves)),
            "async/buffered_groups": float(sum(len(w.groups) for w in self._waves.values())),
            "async/buffer_capacity": float((self.max_staleness + 1)
                                           * (self.prompts_per_step + self.refill_max)),
        }

    async def aclose(self) -> None:
        """Cancel every wave under way and wait for them (idempotent)."""
        self._closed = True
        tasks = [w.task for w in self._waves.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------------- internals
    def _admit(self) -> None:
        if self._closed:
            return
        allowed = waves_allowed(self.steps_done, self.max_staleness, self.waves_total)
        while self._started < allowed:
            problems = self._issue()
            if not problems:
                self.waves_total = self._started  # the data ran out: no more waves
                return
            k = self._started
            self._started += 1
            wave = Wave(index=k, problems=problems, started=time.monotonic(),
                        started_version=self._version())
            wave.task = asyncio.create_task(self._fill(wave), name=f"wave-{k}")
            self._waves[k] = wave
            log.debug("wave_started", wave=k, problems=len(problems),
                      version=wave.started_version)

    def _issue(self, n: int = 0) -> list[Problem]:
        """`n` problems (a wave's `prompts_per_step` by default): resumed ones first, the rest
        from the stream (a resumed run whose waves draw fewer refills than before has a few
        left over for a wave; a stream at its end gives fewer or none)."""
        n = n or self.prompts_per_step
        out, self._resume = self._resume[:n], self._resume[n:]
        return out + (self._next_problems(n - len(out)) if len(out) < n else [])

    async def _fill(self, wave: Wave) -> None:
        """Run the wave's problems, and its refills as their groups call for them."""
        try:
            async with asyncio.TaskGroup() as parts:  # a refill may start while others run

                def start(problems: list[Problem], part: int) -> None:
                    parts.create_task(self._consume(wave, problems, part, start),
                                      name=f"wave-{wave.index}-part-{part}")

                start(list(wave.problems), 0)
        except BaseExceptionGroup as failed:  # the first failure ends the wave (the rest were
            raise failed.exceptions[0] from None  # cancelled): the runner's own error surfaces
        wave.finished = time.monotonic()

    async def _consume(self, wave: Wave, problems: list[Problem], part: int,
                       start: Callable[[list[Problem], int], None]) -> None:
        groups = self._run_wave(problems, wave.started_version, wave.index, part)
        try:
            async for g in groups:
                wave.groups.append(g)
                if (wave.refilled < self.refill_max and self._informative is not None
                        and not self._informative(g)):
                    extra = self._issue(1)
                    if extra:  # none when the data has run out
                        wave.refilled += 1
                        wave.problems.extend(extra)
                        start(extra, wave.refilled)
        finally:  # an async generator's cleanup (cancelling its rollouts) runs now, not at GC
            aclose = getattr(groups, "aclose", None)
            if aclose is not None:
                await aclose()
