"""asyncrl.analysis.policy_drift: KL from the cold-start policy by part of the answer, and the
relative weight change, read from a real tiny model and checkpoints in the trainer's file
layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.analysis import policy_drift as drift
from asyncrl.errors import ModelError


def _cold_run(tmp_path: Path, tokenizer, model) -> Path:
    from asyncrl.modeling import save

    cold = tmp_path / "sft-seed0"
    save(model, tokenizer, cold / "final")
    text = "<reason>Compute it</reason>\n```python\nprint(41 * 7)\n```\n"
    answer = "<answer>\\boxed{287}</answer>"
    prompt = tokenizer("What is 41 times 7?")["input_ids"]
    code = tokenizer(text)["input_ids"]
    out = tokenizer("```output\n287\n```\n")["input_ids"]
    tail = tokenizer(answer)["input_ids"]
    rollout = {"prompt_ids": prompt, "response_ids": code + out + tail,
               "loss_mask": [1] * len(code) + [0] * len(out) + [1] * len(tail)}
    (cold / "eval").mkdir(parents=True)
    (cold / "eval" / "000000-after_sft.jsonl").write_text(
        json.dumps({"rollouts": [rollout, rollout]}) + "\n")
    (cold / "eval" / "000000-after_sft-greedy.jsonl").write_text("")  # not the sample
    return cold


def _checkpoint(run: Path, step: int, state: dict) -> None:
    import torch

    d = run / "checkpoints" / f"step_{step:08d}" / "trainer"
    d.mkdir(parents=True)
    torch.save({"model": state, "lora": {"attached": False}}, d / "trainer.pt")


def test_kl_is_zero_at_the_cold_start_and_grows_where_the_weights_moved(
        tmp_path: Path, tiny_tokenizer, tiny_model_factory) -> None:
    model = tiny_model_factory(0)
    cold = _cold_run(tmp_path, tiny_tokenizer, model)
    answers = drift.cold_answers(cold, tiny_tokenizer, limit=10)
    assert len(answers) == 2 and answers[0]["start"] > 0
    assert {"choice", "code digits", "answer"} <= set(answers[0]["parts"])

    same = {k: v.clone() for k, v in model.state_dict().items() if "lm_head" not in k}
    moved = {k: v.clone() for k, v in same.items()}
    moved["model.norm.weight"] = moved["model.norm.weight"] * 3.0  # sharper every logit
    rl = tmp_path / "roc-weighted-seed0"
    _checkpoint(rl, 0, same)
    _checkpoint(rl, 5, moved)
    assert [s for s, _ in drift.checkpoints(rl)] == [0, 5]

    cold_lp = drift.response_logprobs(model, answers)
    assert drift.drift(cold_lp, cold_lp, answers)["total"] == pytest.approx(0.0, abs=1e-12)
    model.load_state_dict(moved, strict=False)
    out = drift.drift(cold_lp, drift.response_logprobs(model, answers), answers)
    assert out["total"] > 0.01 and out["per_token"] > 0
    assert out["choice"] > 0 and out["answer"] > 0
    # the tool's output tokens are not the model's: a drift there is not counted
    assert out["total"] == pytest.approx(sum(out[c] for c in drift.CLASSES))
    dw = drift.weight_change(dict(same), moved)
    assert dw["norms"] > 0.1 and dw["attention"] == dw["mlp"] == dw["embedding"] == 0.0


def test_a_row_per_checkpoint_and_its_table_line(tmp_path: Path, tiny_tokenizer,
                                                 tiny_model_factory) -> None:
    model = tiny_model_factory(0)
    cold = _cold_run(tmp_path, tiny_tokenizer, model)
    rl = tmp_path / "grpo-all-seed0"
    state = {k: v.clone() for k, v in model.state_dict().items() if "lm_head" not in k}
    _checkpoint(rl, 10, state)
    n, rows = drift.measure(cold, [rl], max_answers=512)
    assert n == 2 and [r["step"] for r in rows] == [10]
    assert rows[0]["kl"]["total"] == pytest.approx(0.0, abs=1e-9)
    assert json.loads(json.dumps(rows)) == rows  # what the script writes as JSON
    text = drift.markdown(rows, n)
    assert text.startswith("KL(cold start || step) summed per answer over 2 cold-start samples")
    assert f"| {tmp_path.name}/grpo-all-seed0 | 10 | 0.0000 |" in text


def test_weights_of_another_model_are_refused(tmp_path: Path, tiny_tokenizer,
                                              tiny_model_factory) -> None:
    model = tiny_model_factory(0)
    cold = _cold_run(tmp_path, tiny_tokenizer, model)
    rl = tmp_path / "other"
    _checkpoint(rl, 5, {"model.layers.9.mlp.up_proj.weight": model.lm_head.weight.clone()})
    with pytest.raises(ModelError, match="do not fit"):
        drift.measure(cold, [rl], max_answers=512)
