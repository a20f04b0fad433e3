"""The micro curriculum's shared TOML sections, for the tests that run `asyncrl train` end to
end in seconds: a one-layer Qwen3 with a tokenizer trained on the task, and tiny_math data.
Each test adds its own `[run]`, `[rollout]`, stages and the rest. Also how those tests run a
command from the repository root (`run_ok`) and read a run's metric rows (`metric_rows`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MICRO_MODEL = """\
[model.init]
model_type = "qwen3"
hidden_size = 32
intermediate_size = 64
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

MICRO_DATA = """\
[data]
train = "generator:tiny_math"
eval = "generator:tiny_math"
max_prompt_tokens = 256
[data.generator_options]
train_size = 64
eval_size = 8
levels = [1, 2]
"""


RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""The environment the tests start runs in: one intra-op thread (two runs may share the
machine's cores), output unbuffered (a test reads it while the run goes on)."""


def run_ok(cmd: list[str]) -> str:
    """Run `cmd` from the repository root in `RUN_ENV`; its output, asserting it exited 0 (the
    output's tail in the failure)."""
    proc = subprocess.run(cmd, cwd=ROOT, env=RUN_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def metric_rows(run_dir: Path, kind: str) -> list[dict]:
    """The rows of `kind` in `run_dir/metrics.jsonl`, in order (none before the file exists)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    return [r for r in rows if r["kind"] == kind]
