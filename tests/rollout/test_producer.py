"""The rollout producer: waves start up to max_staleness steps ahead, are taken in order,
later waves keep generating while a step trains, in-flight waves are handed back for a
checkpoint and regenerated first on resume; and a real local engine updated mid-rollout
stamps each token with the version that sampled it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from asyncrl.engine.base import WeightUpdate
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.records import Group, Problem
from asyncrl.rollout import RolloutSettings, run_rollout
from asyncrl.rollout.producer import RolloutProducer


def _problems(n: int, start: int = 0) -> list[Problem]:
    return [Problem(id=f"p{i}", question="q", answer="1") for i in range(start, start + n)]


class FakeWaves:
    """`run_wave` whose groups finish when the test releases them."""

    def __init__(self) -> None:
        self.started: list[tuple[list[str], int]] = []
        self.release: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.parts: list[tuple[int, int]] = []

    async def __call__(self, problems: list[Problem], version: int, wave: int = 0,
                       part: int = 0) -> AsyncIterator[Group]:
        self.started.append(([p.id for p in problems], version))
        try:
            for p in problems:
                ev = self.release.setdefault(p.id, asyncio.Event())
                await ev.wait()
                yield Group(group_id=f"{p.id}:v{version}", problem=p)
        except asyncio.CancelledError:
            self.cancelled.append(problems[0].id)
            raise

    def finish(self, *ids: str) -> None:
        for i in ids:
            self.release.setdefault(i, asyncio.Event()).set()


class Stream:
    def __init__(self) -> None:
        self.pos = 0

    def next_batch(self, n: int) -> list[Problem]:
        out = _problems(n, self.pos)
        self.pos += n
        return out


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_staleness_two_keeps_three_waves_under_way_and_takes_them_in_order():
    waves, stream, version = FakeWaves(), Stream(), [0]
    async with RolloutProducer(waves, stream.next_batch, prompts_per_step=2, max_staleness=2,
                               waves_total=5, version=lambda: version[0]) as prod:
        await _settle()
        assert [w for w, _ in waves.started] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
        # a later wave finishing first does not jump the queue
        waves.finish("p2", "p3")
        await _settle()
        assert prod.stats()["async/buffered_groups"] == 2.0
        assert prod.stats()["async/buffer_capacity"] == 6.0
        waves.finish("p0", "p1")
        w0 = await prod.take()
        assert w0.index == 0 and [g.problem.id for g in w0.groups] == ["p0", "p1"]
        assert len(waves.started) == 3  # no new wave until the step is done
        version[0] = 1
        prod.step_done()
        await _settle()
        assert waves.started[3] == (["p6", "p7"], 1)
        w1 = await prod.take()
        assert [g.problem.id for g in w1.groups] == ["p2", "p3"] and w1.started_version == 0
        prod.step_done()
        await _settle()
        assert len(waves.started) == 5
        prod.step_done()  # waves_total reached: nothing more starts
        await _settle()
        assert len(waves.started) == 5
        assert [p.id for p in prod.pending_problems()] == ["p4", "p5", "p6", "p7", "p8", "p9"]
    assert sorted(waves.cancelled) == ["p4", "p6", "p8"]  # closing cancels what is under way


async def test_staleness_zero_is_synchronous():
    waves, stream = FakeWaves(), Stream()
    async with RolloutProducer(waves, stream.next_batch, prompts_per_step=1, max_staleness=0,
                               waves_total=3, version=lambda: 0) as prod:
        for k in range(3):
            await _settle()
            assert len(waves.started) == k + 1  # the next wave starts only after the update
            waves.finish(f"p{k}")
            assert (await prod.take()).index == k
            prod.step_done()
        with pytest.raises(RuntimeError):
            await prod.take()


async def test_resumed_problems_are_issued_first_in_order():
    waves, stream = FakeWaves(), Stream()
    stream.pos = 100
    resume = _problems(3, 50)
    async with RolloutProducer(waves, stream.next_batch, prompts_per_step=2, max_staleness=1,
                               waves_total=4, version=lambda: 7,
                               resume_problems=resume) as prod:
        await _settle()
        # a wave is never short while the stream has problems: the last resumed one is
        # topped up from it (refills drawn on resume may leave a few over)
        assert [w for w, _ in waves.started] == [["p50", "p51"], ["p52", "p100"]]
        assert [p.id for p in prod.pending_problems()] == ["p50", "p51", "p52", "p100"]
        waves.finish("p50", "p51", "p52", "p100")
        await prod.take()
        prod.step_done()
        await _settle()
        assert waves.started[2][0] == ["p101", "p102"]


async def test_a_rollout_updated_in_flight_records_each_tokens_version(tiny_tokenizer,
                                                                      tiny_model_factory):
    tok = tiny_tokenizer
    model = tiny_model_factory(0)
    other = tiny_model_factory(1)
    settings = RolloutSettings(max_response_tokens=48, max_turns=1, temperature=1.0, seed=0)
    async with LocalEngine(model, tok, kv_token_budget=4096, max_running=4) as eng:
        task = asyncio.create_task(run_rollout(eng, tok, [], settings, [1, 2, 3, 4],
                                               rollout_id="r0"))
        for _ in range(100_000):  # until mid-generation
            if eng.steps >= 8 or task.done():
                break
            await asyncio.sleep(0.001)
        assert not task.done()
        await eng.update_weights(WeightUpdate(version=1, state_dict={
            k: v.clone() for k, v in other.state_dict().items()}))
        ro = await task
    ro.check()
    assert len(ro.token_versions) == len(ro.response_ids) == ro.num_response_tokens
    assert ro.token_versions[0] == 0 and ro.token_versions[-1] == 1
    assert ro.token_versions == sorted(ro.token_versions)
    assert ro.policy_versions == [0, 1] and ro.policy_version == 0


async def test_a_wave_is_handed_over_in_problem_order_whatever_order_its_groups_finished():
    """RoC draws its random numbers group by group and the update sums over groups in order:
    a seeded run repeats (resumed or not) only if timing cannot reorder them."""
    async def finish_backwards(problems: list[Problem], version: int, wave: int,
                               part: int) -> AsyncIterator[Group]:
        for p in reversed(problems):
            await asyncio.sleep(0)
            yield Group(group_id=f"{p.id}:v{version}", problem=p)

    async with RolloutProducer(finish_backwards, Stream().next_batch, prompts_per_step=3,
                               max_staleness=0, waves_total=1, version=lambda: 0) as prod:
        wave = await prod.take()
    assert [g.problem.id for g in wave.groups] == ["p0", "p1", "p2"]


EQUAL = {"p1", "p3", "p4", "p9"}  # the problems whose groups carry no signal


class ParallelWaves(FakeWaves):
    """As `FakeWaves`, but each group finishes when released, whatever the others do (as a
    runner's groups do)."""

    async def __call__(self, problems: list[Problem], version: int, wave: int = 0,
                       part: int = 0) -> AsyncIterator[Group]:
        self.started.append(([p.id for p in problems], version))
        self.parts.append((wave, part))
        done: asyncio.Queue[Problem] = asyncio.Queue()

        async def one(p: Problem) -> None:
            await self.release.setdefault(p.id, asyncio.Event()).wait()
            done.put_nowait(p)

        tasks = [asyncio.create_task(one(p)) for p in problems]
        try:
            for _ in problems:
                p = await done.get()
                yield Group(group_id=f"{p.id}:v{version}", problem=p)
        except asyncio.CancelledError:
            self.cancelled.append(problems[0].id)
            raise
        finally:
            for t in tasks:
                t.cancel()


def _informative(g: Group) -> bool:
    return g.problem.id not in EQUAL


def _refilling(waves: FakeWaves, stream: Stream, prompts: int, staleness: int, total: int,
               cap: int, resume: list[Problem] | None = None) -> RolloutProducer:
    return RolloutProducer(waves, stream.next_batch, prompts_per_step=prompts,
                           max_staleness=staleness, waves_total=total, version=lambda: 0,
                           refill_max=cap, informative=_informative,
                           resume_problems=resume or [])


async def test_each_group_without_signal_draws_one_more_problem_into_its_wave_up_to_the_cap():
    waves, stream = ParallelWaves(), Stream()
    async with _refilling(waves, stream, 3, 0, total=2, cap=2) as prod:
        await _settle()
        waves.finish("p1")  # no signal: p3 joins the wave
        await _settle()
        assert [w for w, _ in waves.started] == [["p0", "p1", "p2"], ["p3"]]
        assert [p.id for p in prod.pending_problems()] == ["p0", "p1", "p2", "p3"]
        waves.finish("p3", "p2")  # p3 has none either: p4, the last the cap allows
        await _settle()
        waves.finish("p4", "p0")  # p4 has none, but the cap is reached
        wave = await prod.take()
        assert wave.refilled == 2
        assert [g.problem.id for g in wave.groups] == ["p0", "p1", "p2", "p3", "p4"]
        assert [w for w, _ in waves.started] == [["p0", "p1", "p2"], ["p3"], ["p4"]]
        assert waves.parts == [(0, 0), (0, 1), (0, 2)]  # each refill its own seed key
        prod.step_done()
        await _settle()
        assert waves.started[-1][0] == ["p5", "p6", "p7"]  # the stream goes on after them


async def test_refills_are_drawn_in_stream_order_whatever_order_the_groups_finish():
    """Which problems a wave holds depends on its groups' rewards, not on timing, and a
    resumed wave takes its refills from the problems it had before."""
    async def run(order: list[str], resume: list[Problem]) -> list[str]:
        waves, stream = ParallelWaves(), Stream()
        stream.pos = 100 if resume else 0
        async with _refilling(waves, stream, 3, 0, total=1, cap=3, resume=resume) as prod:
            for pid in order:
                await _settle()
                waves.finish(pid)
            wave = await prod.take()
        return [g.problem.id for g in wave.groups]

    first = await run(["p0", "p1", "p2", "p3", "p4", "p5"], [])
    assert first == ["p0", "p1", "p2", "p3", "p4", "p5"]
    assert await run(["p4", "p2", "p3", "p1", "p5", "p0"], []) == first
    assert await run(["p5", "p1", "p4", "p3", "p0", "p2"], _problems(6)) == first


async def test_a_failing_refill_ends_its_wave_with_the_error_and_cancels_the_rest():
    class Broken(ParallelWaves):
        async def __call__(self, problems: list[Problem], version: int, wave: int = 0,
                           part: int = 0) -> AsyncIterator[Group]:
            if problems[0].id == "p3":
                raise RuntimeError("engine died")
            async for g in super().__call__(problems, version, wave, part):
                yield g

    waves = Broken()
    async with _refilling(waves, Stream(), 3, 0, total=1, cap=1) as prod:
        await _settle()
        waves.finish("p1")
        with pytest.raises(RuntimeError, match="engine died"):
            await prod.take()
    assert sorted(waves.cancelled) == ["p0"]


async def test_waves_under_way_together_draw_refills_from_one_stream_without_repeats():
    waves, stream = ParallelWaves(), Stream()
    async with _refilling(waves, stream, 2, 1, total=3, cap=1) as prod:
        await _settle()
        assert [w for w, _ in waves.started] == [["p0", "p1"], ["p2", "p3"]]
        waves.finish("p3")  # wave 1's group without signal draws first: p4 (none either)
        await _settle()
        waves.finish("p1")  # then wave 0's: p5
        await _settle()
        waves.finish("p0", "p2", "p4", "p5")
        w0 = await prod.take()
        prod.step_done()
        w1 = await prod.take()
        prod.step_done()
        await _settle()
        assert [g.problem.id for g in w0.groups] == ["p0", "p1", "p5"]
        assert [g.problem.id for g in w1.groups] == ["p2", "p3", "p4"]  # its cap: p4 draws none
        assert waves.started[-1][0] == ["p6", "p7"]
