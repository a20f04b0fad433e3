"""A lenient second score for saved evaluation answers: the last number a response writes.

The run's reward asks for `<answer>\\boxed{N}</answer>`. A model that never saw that format (an
instruction-tuned model as shipped) answers "The final answer is 4." and scores 0 by format
alone. This score takes the last number of the response's own text (tool outputs left out)
and compares its value with the gold answer, so a baseline is judged on its arithmetic, not
on a format it was never taught. Pure text work over the eval JSONL files a run writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

from asyncrl.records import Group, read_jsonl
from asyncrl.tasks.rewards.math import plain_number

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_OUTPUT_BLOCK = re.compile(r"```output\b.*?(?:```|$)", re.S)


def last_number(text: str) -> Fraction | None:
    """The value of the last number in `text` outside ```` ```output ```` blocks (what the
    sandbox printed is not the model's answer), or None."""
    own = _OUTPUT_BLOCK.sub(" ", text)
    for m in reversed(list(_NUMBER.finditer(own))):
        value = plain_number(m.group().rstrip(","))
        if value is not None:
            return value
    return None


def rescore(groups: Iterable[Group]) -> dict[str, float]:
    """Strict (the run's reward) and lenient (`last_number` equals the gold value) accuracy
    over every answer of the eval `groups`, the answer count, and the tool calls per answer
    (`tool_calls`) and the share of them that failed (`tool_errors`)."""
    n = strict = lenient = calls = failed = 0
    for group in groups:
        gold = plain_number(group.problem.answer)
        for r in group.rollouts:
            n += 1
            strict += r.reward >= 1.0
            got = last_number(r.response_text)
            lenient += got is not None and got == gold
            calls += len(r.tool_calls)
            failed += sum(c.failed for c in r.tool_calls)
    return {"answers": float(n), "strict": strict / max(n, 1), "lenient": lenient / max(n, 1),
            "tool_calls": calls / max(n, 1), "tool_errors": failed / max(calls, 1)}


def rescore_by_source(groups: Iterable[Group]) -> dict[str, dict[str, float]]:
    """`rescore` per problem source (a reasoning-gym generator, a dataset), with "all" first."""
    groups = list(groups)
    by: dict[str, list[Group]] = {}
    for g in groups:
        by.setdefault(g.problem.source or "?", []).append(g)
    return {"all": rescore(groups), **{k: rescore(v) for k, v in sorted(by.items())}}


def rescore_file(path: str | Path) -> dict[str, float]:
    """`rescore` of one eval file a run writes (`eval/*.jsonl`, `eval_groups*.jsonl`)."""
    return rescore(read_jsonl(Path(path), Group))
