"""Where a temperature-1 sample leaves the greedy answer, and why wrong sampled answers are
wrong, read from a run's evaluation files (`bench/sampling_mass.py` prints them).

Every evaluation of a run writes its greedy answers with each token's log-probability under the
untempered distribution (`eval/*-greedy.jsonl`; a greedy-only run's `eval/*.jsonl`). Along that
path, 1 - p(token) is the chance that a sample at temperature 1 writes something else there;
summed over an answer's model-written tokens it is the expected number of places a sample
departs from the greedy answer (to first order), and the share of samples that depart at all is
about 1 - exp(-sum). `mass` splits it by part of the answer (`answer_parts.CLASSES`).

`misses` says where the *sampled* answers that were wrong went wrong (`MISSES`), as a share of
all sampled answers:

- `head`: no tool call; the answer was written from the model's head;
- `program`: the last call's output is not the right answer (a wrong program, or an error);
- `copy`: the last call printed the right answer and the boxed answer differs from it;
- `no answer`: the last call printed the right answer and nothing was boxed.

Reads JSON lines and a tokenizer's `decode`; no model, no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.analysis.answer_parts import CLASSES, classify

MISSES = ("head", "program", "copy", "no answer")


def eval_files(run: Path) -> list[Path]:
    """A run's greedy eval files, or its eval files when it wrote no greedy ones."""
    greedy = sorted(run.glob("eval/*-greedy.jsonl"))
    return greedy or sorted(run.glob("eval/*.jsonl"))


def _answers(path: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(group, rollout) for every answer of one eval file, as plain JSON rows."""
    for line in path.read_text().splitlines():
        if line:
            group = json.loads(line)
            for r in group["rollouts"]:
                yield group, r


def mass(path: Path, tokenizer: Any) -> dict[str, Any]:
    """Expected departures per greedy answer, per class, over one eval file's answers."""
    totals = dict.fromkeys(CLASSES, 0.0)
    answers = tool = right = 0
    for _, r in _answers(path):
        answers += 1
        tool += bool(r.get("tool_calls"))
        right += r.get("reward", 0.0) > 0
        pieces = [tokenizer.decode([t]) for t in r["response_ids"]]
        for lp, kind, mine in zip(r["logprobs"], classify(pieces), r["loss_mask"], strict=True):
            if mine:
                totals[kind] += 1.0 - math.exp(lp)
    n = max(answers, 1)
    per = {k: v / n for k, v in totals.items()}
    total = sum(per.values())
    return {"eval": path.stem.removesuffix("-greedy"), "answers": answers,
            "greedy_right": right / n, "tool_share": tool / n, **per, "total": total,
            "departing_share": 1.0 - math.exp(-total)}


def miss_kind(rollout: dict[str, Any], gold: str) -> str | None:
    """Why one sampled answer is wrong (`MISSES`), or None when it is right."""
    if rollout.get("reward", 0.0) > 0:
        return None
    calls = rollout.get("tool_calls") or []
    if not calls:
        return "head"
    if (calls[-1].get("stdout") or "").strip() != gold.strip():
        return "program"
    return "copy" if rollout.get("answer") not in (None, "") else "no answer"


def misses(path: Path) -> dict[str, Any]:
    """Shares of one sampled eval file's answers that are wrong, by why (`miss_kind`)."""
    counts = dict.fromkeys(MISSES, 0)
    answers = 0
    for group, r in _answers(path):
        answers += 1
        kind = miss_kind(r, str(group["problem"]["answer"]))
        if kind:
            counts[kind] += 1
    n = max(answers, 1)
    return {"eval": path.stem, "sampled": answers, "right": 1.0 - sum(counts.values()) / n,
            **{k: v / n for k, v in counts.items()}}
