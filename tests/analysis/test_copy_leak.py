"""asyncrl.analysis.copy_leak: the teacher-forced leak, 1 - p(gold token) summed by part of the
gold tool transcript, per level."""

from __future__ import annotations

import types

import pytest
import torch

from asyncrl import modeling
from asyncrl.analysis.copy_leak import gold_leak
from asyncrl.sft.coldstart import corpus
from asyncrl.tasks import families as tasks

OPTIONS = {"train_size": 40, "eval_size": 6, "levels": [1, 3]}


class _Teacher:
    """Puts probability 1 on every next gold token, except inside `<answer>...</answer>`
    (after `\\boxed{`), where the gold token gets 0.9: a model that miscopies the output 10% of
    the time at each answer digit, and writes everything else exactly."""

    def __init__(self, tok, vocab: int) -> None:
        self.tok, self.vocab = tok, vocab

    def __call__(self, ids: torch.Tensor) -> types.SimpleNamespace:
        row = ids[0].tolist()
        logits = torch.full((len(row), self.vocab), -1e4)
        pieces = [self.tok.decode([t]) for t in row]
        inside = False
        for i in range(len(row) - 1):
            inside = (inside or pieces[i] == "\\boxed{") and pieces[i + 1] != "}"
            if inside:
                logits[i] = 0.0  # the rest share 0.1
                logits[i, row[i + 1]] = torch.log(torch.tensor(0.9 * (self.vocab - 1) / 0.1))
            else:
                logits[i, row[i + 1]] = 0.0
        return types.SimpleNamespace(logits=logits.unsqueeze(0))


def test_gold_leak_lands_on_the_part_that_leaks() -> None:
    train, problems = tasks.generate("tiny_math", OPTIONS, seed=0)
    tok = modeling.train_tokenizer(corpus("tiny_math", train, tasks.solution_code, 0),
                                   vocab_size=300)
    out = gold_leak(_Teacher(tok, len(tok)), tok, problems, system_prompt="Solve it.",
                    tool_time_s=0.16)
    assert set(out) == {"L1", "L3"}
    for lv, per in out.items():
        digits = [p for p in problems if f"L{int(p.difficulty or 0)}" == lv]
        mean_len = sum(len(str(p.answer)) for p in digits) / len(digits)
        assert per["answer"] == pytest.approx(0.1 * mean_len, rel=1e-3), lv
        assert per["code digits"] == pytest.approx(0.0, abs=1e-6)
        assert per["choice"] == pytest.approx(0.0, abs=1e-6)
        assert per["total"] == pytest.approx(sum(v for k, v in per.items() if k != "total"))
