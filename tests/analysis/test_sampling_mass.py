"""asyncrl.analysis.answer_parts and .sampling_mass: which part of an answer each token belongs
to, and the expected departures of a temperature-1 sample from the greedy path, from an eval
file's log-probs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncrl.analysis import sampling_mass
from asyncrl.analysis.answer_parts import classify

PIECES = ["<reason>", "Compute", " it", "</reason>\n", "```python\n", "print", "(", "4", "1",
          " *", " ", "7", ")\n", "```\n", "```output\n", "287\n", "```\n", "<answer>", "\\boxed{",
          "287", "}", "</answer>", "<|im_end|>"]


def test_classify_by_span() -> None:
    kinds = classify(PIECES)
    assert kinds[1:3] == ["choice", "choice"]
    assert kinds[5:13] == ["code other", "code other", "code digits", "code digits",
                           "code other", "code other", "code digits", "code other"]
    assert kinds[18:21] == ["answer"] * 3
    assert kinds[0] == kinds[13] == kinds[-1] == "other"


class _Vocab:
    def decode(self, ids: list[int]) -> str:
        return PIECES[ids[0]]


def test_mass_sums_one_minus_p_over_model_tokens_only(tmp_path: Path) -> None:
    ids = list(range(len(PIECES)))
    mask = [0 if 14 <= i <= 16 else 1 for i in ids]  # the tool's output is not the model's
    logprobs = [math.log(0.9) if i in (1, 7, 15) else 0.0 for i in ids]
    rollout = {"response_ids": ids, "loss_mask": mask, "logprobs": logprobs, "reward": 1.0,
               "tool_calls": [{}]}
    path = tmp_path / "000010-step-greedy.jsonl"
    path.write_text(json.dumps({"rollouts": [rollout]}) + "\n")
    out = sampling_mass.mass(path, _Vocab())
    assert out["eval"] == "000010-step" and out["answers"] == 1 and out["tool_share"] == 1.0
    assert out["choice"] == pytest.approx(0.1) and out["code digits"] == pytest.approx(0.1)
    assert out["answer"] == 0.0  # token 15 (the output's digits) is masked out
    assert out["total"] == pytest.approx(0.2)
    assert out["departing_share"] == pytest.approx(1 - math.exp(-0.2))


def test_misses_say_why_each_wrong_sampled_answer_is_wrong(tmp_path: Path) -> None:
    def call(stdout: str) -> dict:
        return {"stdout": stdout, "status": "ok"}

    rollouts = [
        {"reward": 1.0, "answer": "287", "tool_calls": [call("287\n")]},
        {"reward": 0.0, "answer": "280", "tool_calls": []},                       # head
        {"reward": 0.0, "answer": "28", "tool_calls": [call("287\n"), call("28\n")]},  # program
        {"reward": 0.0, "answer": "", "tool_calls": [call("")]},                  # program (error)
        {"reward": 0.0, "answer": "278", "tool_calls": [call("287\n")]},          # copy
        {"reward": 0.0, "answer": None, "tool_calls": [call("287\n")]},           # no answer
    ]
    assert [sampling_mass.miss_kind(r, "287") for r in rollouts] == [
        None, "head", "program", "program", "copy", "no answer"]
    path = tmp_path / "000010-step.jsonl"
    path.write_text(json.dumps({"problem": {"answer": 287}, "rollouts": rollouts}) + "\n")
    out = sampling_mass.misses(path)
    assert out["sampled"] == 6 and out["right"] == pytest.approx(1 / 6)
    assert out["program"] == pytest.approx(2 / 6) and out["copy"] == pytest.approx(1 / 6)
