"""`GroupJournal`: an evaluation pass's finished groups on disk as they finish; the same pass run
again answers only the problems the file lacks; and `asyncrl eval` itself, dying mid-pass and
run again (the last test; the train loop's evaluations: `tests/train/test_stop.py`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncrl.errors import DataError
from asyncrl.observe.journal import SUFFIX, GroupJournal, problems_digest
from asyncrl.records import Group, Problem, Rollout

PROBLEMS = [Problem(id=f"q{i}", question=f"{i} + 1 = ?", answer=str(i + 1)) for i in range(5)]


def _group(p: Problem, run: int) -> Group:
    r = Rollout(rollout_id=f"{p.id}-{run}", prompt_id=p.id, group_id=p.id, policy_version=0,
                prompt_ids=[1, 2], response_ids=[3], response_text=p.answer, reward=1.0)
    return Group(group_id=p.id, problem=p, rollouts=[r])


class Runner:
    """Yields a group per problem asked for, in reverse order (completion order is not problem
    order), and raises after `fail_after` groups (a kill mid-pass)."""

    def __init__(self, run: int, fail_after: int | None = None) -> None:
        self.run, self.fail_after, self.asked = run, fail_after, []

    async def __call__(self, rest: list[Problem]) -> AsyncIterator[Group]:
        self.asked.append([p.id for p in rest])
        for i, p in enumerate(reversed(rest)):
            if self.fail_after is not None and i == self.fail_after:
                raise KeyboardInterrupt
            yield _group(p, self.run)


def _journal(tmp_path: Path, **fp: object) -> GroupJournal:
    return GroupJournal(tmp_path / ("eval.jsonl" + SUFFIX),
                        {"problems": problems_digest(PROBLEMS), "k": 1, **fp})


async def test_a_pass_run_again_answers_only_what_the_file_lacks(tmp_path: Path) -> None:
    first = Runner(run=1, fail_after=2)
    try:
        await _journal(tmp_path).collect(PROBLEMS, first)
    except KeyboardInterrupt:
        pass
    assert first.asked == [["q0", "q1", "q2", "q3", "q4"]]
    second = Runner(run=2)
    j = _journal(tmp_path)
    groups = await j.collect(PROBLEMS, second)
    assert j.resumed == 2 and second.asked == [["q0", "q1", "q2"]]  # q4, q3 were on file
    assert [g.problem.id for g in groups] == ["q0", "q1", "q2", "q3", "q4"]  # problem order
    assert [g.rollouts[0].rollout_id for g in groups] == ["q0-2", "q1-2", "q2-2", "q3-1",
                                                          "q4-1"]
    third = Runner(run=3)  # everything on file: nothing is sampled again
    assert [g.rollouts[0].rollout_id for g in await _journal(tmp_path).collect(
        PROBLEMS, third)] == ["q0-2", "q1-2", "q2-2", "q3-1", "q4-1"]
    assert third.asked == []
    j.remove()
    assert not j.path.exists()


async def test_another_pass_replaces_the_file_and_a_torn_line_is_cut(tmp_path: Path) -> None:
    try:
        await _journal(tmp_path, k=1).collect(PROBLEMS, Runner(run=1, fail_after=3))
    except KeyboardInterrupt:
        pass
    path = _journal(tmp_path).path
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"group_id": "q1", "probl')  # a kill inside a write
    again = Runner(run=2)
    groups = await _journal(tmp_path).collect(PROBLEMS, again)
    assert again.asked == [["q0", "q1"]] and len(groups) == 5
    lines = path.read_bytes().splitlines()
    assert len(lines) == 6 and all(json.loads(x) for x in lines)  # header + 5 whole groups

    other = Runner(run=3)  # other settings (k=8): the earlier groups do not count
    groups = await _journal(tmp_path, k=8).collect(PROBLEMS, other)
    assert other.asked == [["q0", "q1", "q2", "q3", "q4"]]
    assert {g.rollouts[0].rollout_id for g in groups} == {f"q{i}-3" for i in range(5)}
    assert json.loads(path.read_bytes().splitlines()[0])["k"] == 8


async def test_a_write_cut_short_is_dropped_and_k_is_part_of_the_pass(tmp_path: Path) -> None:
    results = tmp_path / "eval_groups.jsonl"
    try:
        await GroupJournal.for_pass(results, 1, {"t": 1}, PROBLEMS).collect(
            PROBLEMS, Runner(run=1, fail_after=2))
    except KeyboardInterrupt:
        pass
    path = results.with_name(results.name + SUFFIX)
    # a whole record whose newline a kill cut off: the next append would join it to its line
    path.write_bytes(path.read_bytes() + _group_line(PROBLEMS[0]))
    again = Runner(run=2)
    await GroupJournal.for_pass(results, 1, {"t": 1}, PROBLEMS).collect(PROBLEMS, again)
    assert again.asked == [["q0", "q1", "q2"]]
    third = Runner(run=3)
    await GroupJournal.for_pass(results, 1, {"t": 1}, PROBLEMS).collect(PROBLEMS, third)
    assert third.asked == []  # every line whole: nothing lost to a joined line
    more = Runner(run=4)  # k = 2: one sample a group on file is not a group of this pass
    await GroupJournal.for_pass(results, 2, {"t": 1}, PROBLEMS).collect(PROBLEMS, more)
    assert more.asked == [["q0", "q1", "q2", "q3", "q4"]]


async def test_a_second_pass_into_a_directory_being_written_is_refused(tmp_path: Path) -> None:
    import asyncio

    started = asyncio.Event()

    async def slow(rest: list[Problem]) -> AsyncIterator[Group]:
        started.set()
        await asyncio.sleep(0.5)
        for p in rest:
            yield _group(p, 1)

    first = asyncio.create_task(_journal(tmp_path).collect(PROBLEMS, slow))
    await started.wait()
    other = GroupJournal(tmp_path / ("greedy.jsonl" + SUFFIX), {"k": 1})
    with pytest.raises(DataError, match="another evaluation is writing"):
        await other.collect(PROBLEMS, Runner(run=2))
    assert len(await first) == 5


def _group_line(p: Problem) -> bytes:
    from asyncrl.records import to_json

    return to_json(_group(p, 9))


async def test_asyncrl_eval_killed_mid_pass_goes_on_from_its_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `asyncrl eval`'s own function on the micro model: the first try dies after two groups
    # reached the disk (as a kill would leave it); the same call again samples only the rest
    from micro_config import MICRO_DATA, MICRO_MODEL

    from asyncrl import config
    from asyncrl.cli.eval import evaluate
    from asyncrl.observe import journal as journal_mod
    from asyncrl.records import read_jsonl

    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "ev"\nseed = 3\n' + MICRO_MODEL + MICRO_DATA
                    + '[rollout]\nmax_turns = 2\nmax_response_tokens = 24\n'
                    + 'tool_format = "markdown"\n[engine]\nkv_token_budget = 8192\n'
                    + '[sandbox]\nworkers = 1\n[eval]\nk = 2\ngreedy = false\n'
                    + '[[stages]]\nname = "rl"\nsteps = 1\n')
    cfg = config.load(path)
    out = tmp_path / "ev"
    real_fsync, synced = journal_mod.os.fsync, []

    class Killed(Exception):
        pass

    def dying_fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(fd)
        if len(synced) == 2:
            raise Killed

    monkeypatch.setattr(journal_mod.os, "fsync", dying_fsync)
    with pytest.raises(Killed):
        await evaluate(cfg, cfg.data.eval, 2, out)
    monkeypatch.setattr(journal_mod.os, "fsync", real_fsync)
    partial = out / ("eval_groups.jsonl" + SUFFIX)
    kept = partial.read_bytes().splitlines()[1:]
    assert len(kept) == 2 and not (out / "eval.json").exists()

    summary = await evaluate(cfg, cfg.data.eval, 2, out)
    assert summary["resumed_groups"] == 2.0 and not partial.exists()
    groups = read_jsonl(out / "eval_groups.jsonl", Group)
    assert len(groups) == 8 and len({g.problem.id for g in groups}) == 8
    # the two groups from before the kill, unchanged
    on_file = {json.loads(x)["group_id"]: json.loads(x) for x in kept}
    for g in groups:
        if g.group_id in on_file:
            assert [r.rollout_id for r in g.rollouts] == [
                r["rollout_id"] for r in on_file[g.group_id]["rollouts"]]
    assert sum(g.group_id in on_file for g in groups) == 2
