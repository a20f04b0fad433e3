"""Two evaluations of one held-out set, compared problem by problem.

`asyncrl eval --k K` writes each problem's K answers to `eval_groups.jsonl` (while it runs, to
its journal `eval_groups.jsonl.partial`). Two checkpoints evaluated on the same problems (a
cold start and its RL, or the RoC and GRPO arms of one seed) differ by more than their noise
only where the per-problem differences say so: `compare` pairs the problems both evaluations
hold (by problem id) and gives, per source and over all, each side's avg@K, the mean paired
difference with a 95% bootstrap interval over the problems, and each side's share of tool
calls that failed inside its correct answers (what RoC claims to lower). Pure work over the
files; nothing here samples.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from asyncrl.records import Group

RESAMPLES = 2000
"""Bootstrap resamples of the paired differences."""


def read_groups(path: Path) -> list[Group]:
    """The groups of an evaluation's results file, or of its journal while it runs: a first
    line that is no group (the journal's fingerprint) and a last line a kill cut short are
    left out; any other line that is no group, or a file with none, is a `ValueError`."""
    dec = msgspec.json.Decoder(Group)
    lines = [x for x in path.read_bytes().split(b"\n") if x.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(dec.decode(line))
        except msgspec.DecodeError:
            if 0 < i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not an evaluation group") from None
    if not out:
        raise ValueError(f"{path}: no evaluation groups in it")
    return out


def _figures(g: Group) -> tuple[float, int, int]:
    """One problem's share of correct answers, and the tool calls (all, failed) inside them."""
    right = [r for r in g.rollouts if r.is_correct]
    calls = sum(len(r.tool_calls) for r in right)
    failed = sum(c.failed for r in right for c in r.tool_calls)
    return len(right) / max(len(g.rollouts), 1), calls, failed


def _interval(diffs: Sequence[float], resamples: int, seed: int) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the mean of `diffs` resampled with replacement."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    return means[round(0.025 * (resamples - 1))], means[round(0.975 * (resamples - 1))]


def _row(pairs: list[tuple[Group, Group]], resamples: int, seed: int) -> dict[str, float]:
    fa = [_figures(a) for a, _ in pairs]
    fb = [_figures(b) for _, b in pairs]
    diffs = [y[0] - x[0] for x, y in zip(fa, fb, strict=True)]
    lo, hi = _interval(diffs, resamples, seed)
    n = len(pairs)

    def tool_errors(f: list[tuple[float, int, int]]) -> float:
        return sum(x[2] for x in f) / max(sum(x[1] for x in f), 1)

    return {"problems": float(n), "avg_a": sum(x[0] for x in fa) / n,
            "avg_b": sum(x[0] for x in fb) / n, "diff": sum(diffs) / n, "diff_lo": lo,
            "diff_hi": hi, "tool_errors_correct_a": tool_errors(fa),
            "tool_errors_correct_b": tool_errors(fb),
            "calls_correct_a": float(sum(x[1] for x in fa)),
            "calls_correct_b": float(sum(x[1] for x in fb))}


def compare(a: Iterable[Group], b: Iterable[Group], *, resamples: int = RESAMPLES,
            seed: int = 0) -> dict[str, dict[str, float]]:
    """B against A over the problems both hold, "all" first, then one row per problem source.
    A problem's avg is the share of its answers that are correct, so the two sides may have
    sampled different numbers of answers; a problem without answers on either side, and a
    repeated id's later copies, are left out. Raises ValueError when the two share no
    problem, or when a shared id is another question or answer on each side (evaluations of
    two different held-out sets: ids are positions in a set, not its content)."""
    first: dict[str, Group] = {}
    for g in a:
        first.setdefault(g.problem.id, g)
    pairs: dict[str, tuple[Group, Group]] = {}
    for g in b:
        f = first.get(g.problem.id)
        if f is not None and f.rollouts and g.rollouts:
            pairs.setdefault(g.problem.id, (f, g))
    other = [i for i, (x, y) in pairs.items()
             if (x.problem.question, x.problem.answer) != (y.problem.question, y.problem.answer)]
    if other:
        raise ValueError(f"{len(other)} of the {len(pairs)} shared problem ids ({other[0]} "
                         "first) are other problems on each side: two different held-out sets")
    if not pairs:
        raise ValueError("the two evaluations share no problem id")
    by: dict[str, list[tuple[Group, Group]]] = {}
    for p in pairs.values():
        by.setdefault(p[0].problem.source or "?", []).append(p)
    return {"all": _row(list(pairs.values()), resamples, seed),
            **{k: _row(v, resamples, seed) for k, v in sorted(by.items())}}
