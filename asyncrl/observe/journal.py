"""An evaluation's finished groups, written as they finish, so that a stop loses only the rest.

A real model's evaluation on a CPU runs for an hour or more (SmolLM2's avg@8 on 208 word
problems: 74 minutes on 2 cores). Kept in memory until its end, every answer of it was lost to
a Ctrl-C, a preemption or a killed session, and the next try started over.

Owns: `GroupJournal`, one JSON-lines file per evaluation pass (`for_pass` names it after the
pass's results file): its first line the pass's fingerprint (what must be equal for earlier
groups to count: the weights, the problems with their answers, the task, k, the sampling
settings), then one finished `Group` a line, fsynced as each finishes (in a worker thread).
`collect` runs the pass over the problems the file does not hold yet, appending each group,
and returns every group in problem order; a file with another fingerprint is replaced (a
different pass wrote it), bytes after the last newline (a write a kill cut) are dropped. One
pass writes in a directory at a time (an exclusive `flock` on it: a second evaluation into
the same directory is refused, not mixed in). It logs the pass's progress (`eval_progress`:
groups and answers done, rate, estimated seconds left) once a minute. The caller removes the
file once the pass's results are written, and `discard` drops what a run cannot trust (the
train loop's journals after a kill: the step it redoes may end on other weights). Does not
own: sampling or rewarding (the runner), what an evaluation reports (`evaluation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.errors import DataError
from asyncrl.log import get_logger
from asyncrl.records import Group, Problem, in_problem_order, to_json

log = get_logger(__name__)

PROGRESS_EVERY_S = 60.0
"""Seconds between two `eval_progress` log lines of one pass."""

SUFFIX = ".partial"
"""Appended to the pass's results file name (`eval_groups.jsonl.partial`): globs of `*.jsonl`
never read an unfinished pass."""


def _digest(parts: Sequence[bytes]) -> str:
    return hashlib.sha256(b"\n".join(parts)).hexdigest()[:16]


def problems_digest(problems: Sequence[Problem]) -> str:
    """A short digest of the problems, in order, each whole (its answer too)."""
    return _digest([to_json(p) for p in problems])


def weights_digest(model_dir: str | Path) -> str:
    """Names, sizes and modification times of a model directory's weight files: a retrained
    checkpoint written to the same path is another model."""
    d = Path(model_dir)
    files = sorted(f for f in d.glob("*") if f.suffix in (".safetensors", ".bin", ".pt"))
    parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return _digest([str(d.resolve()).encode(), *(x.encode() for x in parts)])


def settings_digest(settings: Any) -> Any:
    """The sampling settings as plain values (a tool format's parsers by their names)."""
    return msgspec.to_builtins(
        settings, enc_hook=lambda o: getattr(o, "__qualname__", type(o).__name__))


def discard(directory: Path, keep: str = "") -> int:
    """Remove the journals in `directory` but those whose name starts with `keep` (non-empty);
    returns how many went."""
    found = [f for f in (directory.glob("*" + SUFFIX) if directory.is_dir() else [])
             if not (keep and f.name.startswith(keep))]
    for f in found:
        f.unlink(missing_ok=True)
    return len(found)


class GroupJournal:
    """The finished groups of one evaluation pass at `path` (see the module docstring)."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], *, what: str = "eval") -> None:
        self.path = path
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        self.what = what
        self.resumed = 0
        """Groups the file held when `collect` started."""

    @classmethod
    def for_pass(cls, results: Path, k: int, settings: Any, problems: Sequence[Problem],
                 **identity: Any) -> GroupJournal:
        """The journal of the pass whose results go to `results` (`NAME.jsonl.partial`
        beside it): `k` samples per problem of `problems` under `settings`, with `identity`
        (the weights, the task) in its fingerprint."""
        return cls(results.with_name(results.name + SUFFIX),
                   {**identity, "k": k, "problems": problems_digest(problems),
                    "settings": settings_digest(settings)})

    def _load(self, problems: Sequence[Problem]) -> list[Group]:
        """The groups on file for `problems` (an unknown or repeated problem's are dropped);
        the file is replaced when its fingerprint differs and cut after its last whole line."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]  # after the last newline: a write cut short
        lines = whole.split(b"\n")[:-1]
        try:
            head = json.loads(lines[0]) if lines else None
        except ValueError:
            head = None
        if head != self.fingerprint:
            log.warning("eval_journal_replaced", path=str(self.path), what=self.what,
                        reason="another pass wrote it" if head is not None else "unreadable")
            self.path.unlink()
            return []
        wanted = {p.id for p in problems}
        groups: dict[str, Group] = {}
        good = len(lines[0]) + 1
        dec = msgspec.json.Decoder(Group)
        for line in lines[1:]:
            try:
                g = dec.decode(line) if line.strip() else None
            except msgspec.DecodeError:  # not a whole record: it and what follows go
                break
            good += len(line) + 1
            if g is not None and g.problem.id in wanted:
                groups.setdefault(g.problem.id, g)
        if good < len(data):
            with self.path.open("r+b") as fp:
                fp.truncate(good)
        return list(groups.values())

    async def collect(self, problems: Sequence[Problem],
                      run: Callable[[list[Problem]], AsyncIterator[Group]]) -> list[Group]:
        """Every problem's group: those on file, then `run(rest)`'s, each appended as it comes
        (one per problem, as `RolloutRunner.run` yields them). In problem order."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            return await self._collect(problems, run)

    @contextlib.contextmanager
    def _locked(self) -> Any:
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DataError(f"another evaluation is writing in {self.path.parent}: give "
                                "this one another output directory") from None
            yield
        finally:
            os.close(fd)  # releases the lock

    async def _collect(self, problems: Sequence[Problem],
                       run: Callable[[list[Problem]], AsyncIterator[Group]]) -> list[Group]:
        done = await asyncio.to_thread(self._load, problems)  # a journal may be large
        self.resumed = len(done)
        have = {g.problem.id for g in done}
        rest = [p for p in problems if p.id not in have]
        if done:
            log.info("eval_resumed", what=self.what, groups=len(done), left=len(rest),
                     path=str(self.path))
        fresh = not self.path.exists()
        with self.path.open("ab") as fp:
            if fresh:
                fp.write(json.dumps(self.fingerprint, sort_keys=True).encode() + b"\n")
                fp.flush()
            if rest:
                groups = run(rest)
                try:
                    await self._append_all(fp, groups, done, len(problems))
                finally:  # a generator left early cancels its rollouts now, not at collection
                    aclose = getattr(groups, "aclose", None)
                    if aclose is not None:
                        await aclose()
        return in_problem_order(done, problems)

    async def _append_all(self, fp: Any, groups: AsyncIterator[Group], done: list[Group],
                          total: int) -> None:
        """Each of `groups` onto the file and into `done`, logging progress once a minute."""
        t0 = last = time.monotonic()
        answers = 0
        async for g in groups:
            await asyncio.to_thread(_append, fp, to_json(g) + b"\n")
            done.append(g)
            answers += len(g.rollouts)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                rate = (len(done) - self.resumed) / (now - t0)
                log.info("eval_progress", what=self.what, groups=len(done), of=total,
                         answers=answers, answers_per_s=round(answers / (now - t0), 3),
                         eta_s=round((total - len(done)) / rate))

    def remove(self) -> None:
        """The pass's results are written: the journal is no longer needed."""
        self.path.unlink(missing_ok=True)


def _append(fp: Any, line: bytes) -> None:
    """One whole line on disk (a worker thread's: an fsync may take long on a shared file
    system, and the event loop streams the engines' tokens)."""
    fp.write(line)
    fp.flush()
    os.fsync(fp.fileno())
