"""An evaluation's finished groups, written as they finish, so that a stop loses only the rest.

A real model's evaluation on a CPU runs for an hour or more (SmolLM2's avg@8 on 208 word
problems: 74 minutes on 2 cores). Kept in memory until its end, every answer of it was lost to
a Ctrl-C, a preemption or a killed session, and the next try started over.

Owns: `GroupJournal`, one JSON-lines file per evaluation pass: its first line the pass's
`fingerprint` (what must be equal for earlier groups to count: the weights, the problems, k,
the sampling settings), then one finished `Group` a line, fsynced as each finishes.
`collect` runs the pass over the problems the file does not hold yet, appending each group,
and returns every group in problem order; a file with another fingerprint is replaced (a
different pass wrote it), a last line torn by a kill is cut off. It logs the pass's progress
(`eval_progress`: groups and answers done, rate, estimated seconds left) once a minute. The
caller removes the file once the pass's results are written. Does not own: sampling or
rewarding (the runner), what an evaluation reports (`evaluation`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.log import get_logger
from asyncrl.records import Group, Problem, to_json

log = get_logger(__name__)

PROGRESS_EVERY_S = 60.0
"""Seconds between two `eval_progress` log lines of one pass."""

SUFFIX = ".partial"
"""Appended to the pass's results file name (`eval_groups.jsonl.partial`): globs of `*.jsonl`
never read an unfinished pass."""


def problems_digest(problems: Sequence[Problem]) -> str:
    """A short digest of the problems' ids, in order (a fingerprint's `problems`)."""
    return hashlib.sha256("\n".join(p.id for p in problems).encode()).hexdigest()[:16]


def weights_digest(model_dir: str | Path) -> str:
    """Names, sizes and modification times of a model directory's weight files: a retrained
    checkpoint written to the same path is another model."""
    d = Path(model_dir)
    files = sorted(f for f in d.glob("*") if f.suffix in (".safetensors", ".bin", ".pt"))
    parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join([str(d.resolve()), *parts]).encode()).hexdigest()[:16]


def settings_digest(settings: Any) -> Any:
    """The sampling settings as plain values (a tool format's parsers by their names)."""
    return msgspec.to_builtins(
        settings, enc_hook=lambda o: getattr(o, "__qualname__", type(o).__name__))


class GroupJournal:
    """The finished groups of one evaluation pass at `path` (see the module docstring)."""

    def __init__(self, path: Path, fingerprint: dict[str, Any], *, what: str = "eval") -> None:
        self.path = path
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        self.what = what
        self.resumed = 0
        """Groups the file held when `collect` started."""

    def _load(self, problems: Sequence[Problem]) -> list[Group]:
        """The groups on file for `problems` (an unknown or repeated problem's are dropped);
        the file is replaced when its fingerprint differs and cut after its last whole line."""
        if not self.path.exists():
            return []
        lines = self.path.read_bytes().split(b"\n")
        try:
            head = json.loads(lines[0])
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
            if not line.strip():
                good += len(line) + 1
                continue
            try:
                g = dec.decode(line)
            except msgspec.DecodeError:  # a line torn by a kill: it and what follows go
                break
            good += len(line) + 1
            if g.problem.id in wanted:
                groups.setdefault(g.problem.id, g)
        size = self.path.stat().st_size
        if good < size:
            with self.path.open("r+b") as fp:
                fp.truncate(good)
        return list(groups.values())

    async def collect(self, problems: Sequence[Problem],
                      run: Callable[[list[Problem]], AsyncIterator[Group]]) -> list[Group]:
        """Every problem's group: those on file, then `run(rest)`'s, each appended as it comes
        (one per problem, as `RolloutRunner.run` yields them). In problem order."""
        done = self._load(problems)
        self.resumed = len(done)
        have = {g.problem.id for g in done}
        rest = [p for p in problems if p.id not in have]
        if done:
            log.info("eval_resumed", what=self.what, groups=len(done), left=len(rest),
                     path=str(self.path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists()
        t0 = last = time.monotonic()
        answers = 0
        with self.path.open("ab") as fp:
            if fresh:
                fp.write(json.dumps(self.fingerprint, sort_keys=True).encode() + b"\n")
            if rest:
                async for g in run(rest):
                    fp.write(to_json(g) + b"\n")
                    fp.flush()
                    os.fsync(fp.fileno())
                    done.append(g)
                    answers += len(g.rollouts)
                    now = time.monotonic()
                    if now - last >= PROGRESS_EVERY_S:
                        last = now
                        new = len(done) - self.resumed
                        rate = new / (now - t0)
                        log.info("eval_progress", what=self.what, groups=len(done),
                                 of=len(problems), answers=answers,
                                 answers_per_s=round(answers / (now - t0), 3),
                                 eta_s=round((len(problems) - len(done)) / rate))
        order = {p.id: i for i, p in reversed(list(enumerate(problems)))}
        return sorted(done, key=lambda g: order.get(g.problem.id, len(order)))

    def remove(self) -> None:
        """The pass's results are written: the journal is no longer needed."""
        self.path.unlink(missing_ok=True)
