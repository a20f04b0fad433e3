"""How much a policy would miscopy along a gold tool transcript: the teacher-forced leak.

The model reads each problem's gold tool transcript (`asyncrl.sft.coldstart`, kind `tool`: the
call, the tool's real output, the boxed answer) and at every model-written token takes
1 - p(the gold token), summed per transcript by part of the answer (`answer_parts.CLASSES`).
The `answer` part is how often a temperature-1 sample would miscopy the tool's output into
`\\boxed{}`, `code digits` the question's numbers into the program; `choice` is high by design
after the SFT stage (its transcripts answer directly a share of the time), and `code other`
includes the fail-and-fix habit the cold start is taught. `bench/copy_probe.py` prints it.

Needs a causal LM (anything whose call returns `.logits`) and its tokenizer; torch is imported
when a leak is measured, not with the module.
"""

from __future__ import annotations

import collections
import random
from typing import Any

from asyncrl import formats
from asyncrl.analysis.answer_parts import CLASSES, classify
from asyncrl.sft.coldstart import render_transcript, tokenize
from asyncrl.tasks.families import solution_code
from asyncrl.tasks.task import SolutionCode


def gold_leak(model: Any, tok: Any, problems: list[Any], system_prompt: str,
              tool_time_s: float = 0.01,
              code_for: SolutionCode = solution_code) -> dict[str, dict[str, float]]:
    """Per level (`"L{n}"`): the mean over problems of sum(1 - p(gold token)) over the
    model-written tokens of the gold tool transcript (its program from `code_for`: the built-in
    families' by default) whose output shows `tool_time_s`, by part (`CLASSES`), and `total`."""
    import torch

    fmt = formats.get_format("markdown")
    sums: dict[int, dict[str, float]] = {}
    counts: collections.Counter[int] = collections.Counter()
    for p in problems:
        ids, mask = tokenize(render_transcript(p, fmt, "tool", random.Random(0),
                                               code=code_for(p), system_prompt=system_prompt,
                                               duration_s=tool_time_s), tok)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        first = mask.index(1)
        kinds = classify([tok.decode([t]) for t in ids[first:]])
        lv = int(p.difficulty or 0)
        row = sums.setdefault(lv, dict.fromkeys(CLASSES, 0.0))
        counts[lv] += 1
        for i, kind in enumerate(kinds, start=first):
            if mask[i]:
                row[kind] += 1.0 - float(logp[i - 1, ids[i]].exp())
    out = {}
    for lv, row in sorted(sums.items()):
        per = {k: v / counts[lv] for k, v in row.items()}
        out[f"L{lv}"] = {**per, "total": sum(per.values())}
    return out
