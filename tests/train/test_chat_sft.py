"""An SFT stage fed from a chat file with tool calls, end to end through `train_async`: rendered
by the model's own (Qwen2.5) chat template, its loss falls, its held-out loss is measured, its
bad rows are reported by line, and a run stopped mid-stage resumes on the same batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from micro_config import metric_rows

from asyncrl import config
from asyncrl.rollout.eventloop import run as run_loop
from asyncrl.train import train_async

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "qwen2.5-instruct.jinja"


def _chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = 3 + i % 7, 11 + i % 5
        call = {"type": "function", "function": {
            "name": "python_code_with_standard_io",
            "arguments": json.dumps({"code": f"print({a}*{b})", "input": ""})}}
        rows.append({"messages": [
            {"role": "user", "content": f"What is {a} times {b}?"},
            {"role": "assistant", "content": "Let me compute it.", "tool_calls": [call]},
            {"role": "tool", "content": f"Execution succeeded.\n{a * b}\nTime: 0.01s"},
            {"role": "assistant", "content": f"The answer is <answer>\\boxed{{{a * b}}}</answer>"}]})
    return rows


BAD = [{"messages": [{"content": "who am I"}, {"role": "assistant", "content": "x"}]},
       {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                     {"role": "assistant", "content": "a"}]},
       {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {
                          "name": "f", "arguments": "{oops"}}]}]}]


def _setup(tmp_path: Path, steps: int) -> config.RunConfig:
    from asyncrl.modeling import train_tokenizer

    rows = _chat_rows(60)
    lines = [json.dumps(r) for r in rows[:20]] + [json.dumps(r) for r in BAD] + [
        json.dumps(r) for r in rows[20:]]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(lines) + "\n")
    corpus = [json.dumps(r) for r in rows] * 3 + ["What is 1 + 2? 0123456789"] * 10
    tok = train_tokenizer(corpus, vocab_size=400)
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(tmp_path / "tok")
    return config.from_dict({
        "run": {"name": "chat", "seed": 1},
        "model": {"init": {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "head_dim": 16,
                           "max_position_embeddings": 1024, "tie_word_embeddings": True}},
        "tokenizer": {"path": str(tmp_path / "tok")},
        "data": {"train": "generator:tiny_math", "chat_template": "model",
                 "generator_options": {"train_size": 8, "eval_size": 2, "levels": [1]}},
        "rollout": {"tool_format": "hermes", "prompts_per_step": 1, "samples_per_prompt": 2,
                    "group_size": 2, "max_response_tokens": 64},
        "engine": {"kv_token_budget": 4096},
        "sandbox": {"workers": 1},
        "stages": [{"name": "cold", "kind": "sft", "steps": steps, "batch_size": 8,
                    "lr": 3e-3, "chat": {"train": [str(chat)], "valid_fraction": 0.2,
                                         "valid_every": 10, "max_bad_fraction": 0.1,
                                         "max_tokens": 512}}],
        "checkpoint": {"sft_every_steps": 10, "keep_last": 1},
        "logging": {"console": "none"},
    })


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chat_file_sft_learns_reports_bad_rows_and_resumes(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, steps=40)
    full = run_loop(train_async(cfg, run_dir=str(tmp_path / "full")))
    (data,) = metric_rows(full, "sft_data")
    assert data["rows"] == 63 and data["bad"] == 3 and data["train"] + data["valid"] == 60
    assert data["bad/missing_role"] == data["bad/tool_without_call"] == 1
    assert data["bad/bad_arguments"] == 1
    chat = tmp_path / "chat.jsonl"
    bad = [json.loads(x) for x in (full / "log.jsonl").read_text().splitlines()]
    assert sorted(e["where"] for e in bad if e.get("event") == "bad_chat_row") == [
        f"{chat}:21", f"{chat}:22", f"{chat}:23"]
    valid = [r["sft/valid_loss"] for r in metric_rows(full, "sft_valid")]
    assert len(valid) == 4 and valid[-1] < valid[0] - 0.5  # held-out loss falls
    train = [r["sft/loss"] for r in metric_rows(full, "sft_step")]
    assert train[-1] < train[0]

    # Stop after 20 steps (a checkpoint at step 20 holds the chat cursor), then resume to 40.
    part = tmp_path / "part"
    run_loop(train_async(_setup(tmp_path, steps=20), run_dir=str(part)))
    run_loop(train_async(cfg, run_dir=str(part), resume=True))
    after = {r["sft_step"]: r["sft/loss"] for r in metric_rows(part, "sft_step")}
    assert after[30] == pytest.approx(metric_rows(full, "sft_step")[2]["sft/loss"], rel=1e-4)
    assert after[40] == pytest.approx(train[-1], rel=1e-4)


@pytest.mark.timeout(600)
def test_a_stop_inside_a_chat_sft_step_resumes_on_the_same_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The chat path's cursor moves when a batch is drawn: a step given up for a stop must put
    # it back, or the resumed run skips that batch (`StepAbandoned`, asyncrl/stopping.py).
    from msgspec.structs import replace

    from asyncrl.algo import step as step_mod
    from asyncrl.errors import StepAbandoned
    from asyncrl.stopping import StopRequest

    cfg = _setup(tmp_path, steps=6)
    cfg = replace(cfg, trainer=replace(cfg.trainer, micro_batch_tokens=256))  # several a step
    full = run_loop(train_async(cfg, run_dir=str(tmp_path / "full")))
    want = metric_rows(full, "sft_step")[-1]

    stop, calls = StopRequest(), {"steps": 0, "mb": 0}
    real_step, real_loss = step_mod.sft_step, step_mod.sft_loss

    def sft_step(*a, **k):
        calls["steps"] += 1
        calls["mb"] = 0
        return real_step(*a, **k)

    def sft_loss(*a, **k):
        calls["mb"] += 1
        if calls["steps"] == 4 and calls["mb"] == 1:
            stop.request()
        return real_loss(*a, **k)

    monkeypatch.setattr(step_mod, "sft_step", sft_step)
    monkeypatch.setattr(step_mod, "sft_loss", sft_loss)
    part = tmp_path / "part"
    with pytest.raises(StepAbandoned) as info:
        run_loop(train_async(cfg, run_dir=str(part), stop=stop))
    assert info.value.where.startswith("stage cold step 3/6")
    run_loop(train_async(cfg, run_dir=str(part), resume=True))
    got = metric_rows(part, "sft_step")[-1]
    assert got["sft_step"] == want["sft_step"] == 6
    assert got["sft/loss"] == pytest.approx(want["sft/loss"], rel=1e-6)
