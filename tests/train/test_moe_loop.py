"""`asyncrl train` on a mixture-of-experts model, end to end in seconds: a one-layer Qwen3-MoE
through the local engine and the torch trainer, routing replay on by default. The engine's
records reach the saved rollouts (one row per token but the last sampled, multi-turn
rollouts included) and every RL step reports how often the trainer's router would have
chosen otherwise; `routing_replay = false` records nothing."""

from __future__ import annotations

import base64
import sys

import pytest
from micro_config import MICRO_DATA, MICRO_RL_TAIL, metric_rows, run_ok, saved_rollouts

MOE_MODEL = """\
[model.init]
model_type = "qwen3_moe"
hidden_size = 32
intermediate_size = 64
moe_intermediate_size = 16
num_experts = 4
num_experts_per_tok = 2
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 512
tie_word_embeddings = true
[tokenizer]
train_on = "task_corpus"
vocab_size = 400
"""

ROLLOUT = """\
[rollout]
prompts_per_step = 2
samples_per_prompt = 4
group_size = 2
max_turns = 2
max_response_tokens = 32
tool_format = "markdown"
[roc]
kind = "grpo_all"
reject_equal_reward = false
"""


@pytest.mark.parametrize("replay", [None, pytest.param(False, marks=pytest.mark.slow)])
def test_moe_run_records_and_replays_routing(tmp_path, replay) -> None:
    cfg = tmp_path / "moe.toml"
    algo = "" if replay is None else f"[algorithm]\nrouting_replay = {str(replay).lower()}\n"
    cfg.write_text(MOE_MODEL + MICRO_DATA + ROLLOUT + algo + MICRO_RL_TAIL)
    run_dir = tmp_path / "run"
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir)])
    steps = metric_rows(run_dir, "rl_step")
    assert [r["step"] for r in steps] == [1, 2]
    rolls = saved_rollouts(run_dir)
    assert rolls
    if replay is False:
        assert all(r["routed_experts"] is None for r in rolls)
        assert all("train/routing_replay_changed" not in r for r in steps)
        return
    for r in rolls:
        rec = r["routed_experts"]
        assert (rec["layers"], rec["top_k"], rec["itemsize"]) == (1, 2, 1)
        n = len(base64.b64decode(rec["data"])) // 2
        # the last turn's record: every token before its last sampled one (a tool's output
        # after the last turn has none)
        last = max(t["end"] for t in r["turns"] if t["role"] == "assistant")
        assert n == len(r["prompt_ids"]) + last - 1
        assert set(base64.b64decode(rec["data"])) <= {0, 1, 2, 3}
    for s in steps:  # fp32 engine and trainer, same weights: no decision flips
        assert s["train/routing_replay_changed"] < 0.01
        assert s["train/routing_replay_tokens"] > 0
