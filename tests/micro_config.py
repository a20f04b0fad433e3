"""The micro curriculum's shared TOML sections, for the tests that run `asyncrl train` end to
end in seconds: a one-layer Qwen3 with a tokenizer trained on the task, and tiny_math data.
Each test adds its own `[run]`, stages and the rest: `micro_rollout(...)` the `[rollout]` and
`[roc]` (with the test's changes), `MICRO_ENGINE` the engine and sandbox, `MICRO_RL_TAIL` two
RL steps that save every rollout. Also how those tests run a command (`run_ok`, or several at once: `run_all_ok`) and read a run's metric
rows (`metric_rows`) and saved rollouts (`saved_rollouts`)."""

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


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def micro_rollout(roc: dict[str, object] | None = None, **rollout: object) -> str:
    """`[rollout]` and `[roc]` of a micro run: two prompts of four samples kept as groups of
    two, two turns of at most 24 tokens in markdown, RoC with one positive and one negative;
    `rollout` and `roc` add or replace keys (a value of None drops one)."""
    keys = {"prompts_per_step": 2, "samples_per_prompt": 4, "group_size": 2, "max_turns": 2,
            "max_response_tokens": 24, "tool_format": "markdown", **rollout}
    roc_keys = {"min_pos": 1, "min_neg": 1, **(roc or {})}
    lines = ["[rollout]"] + [f"{k} = {_toml_value(v)}" for k, v in keys.items() if v is not None]
    lines += ["[roc]"] + [f"{k} = {_toml_value(v)}" for k, v in roc_keys.items() if v is not None]
    return "\n".join(lines) + "\n"


MICRO_ENGINE = """\
[engine]
kv_token_budget = 8192
[sandbox]
workers = 1
time_limit_s = 2.0
"""
"""The local engine and one sandbox worker of a micro run (a two-second tool limit)."""


MICRO_RL_TAIL = """\
[engine]
kv_token_budget = 8192
[sandbox]
workers = 1
[[stages]]
name = "rl"
steps = 2
[eval]
every_steps = 2
max_problems = 2
[checkpoint]
every_steps = 0
[logging]
console = "json"
rollouts_every = 1
"""
"""After a test's `[rollout]` and `[roc]`: two RL steps, an evaluation at the second, no
checkpoints, JSON logs, every step's rollouts saved (`saved_rollouts`)."""


RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""The environment the tests start runs in: one intra-op thread (two runs may share the
machine's cores), output unbuffered (a test reads it while the run goes on)."""


def run_ok(cmd: list[str], cwd: Path = ROOT, python_path: str = "") -> str:
    """Run `cmd` in `cwd` (the repository root) in `RUN_ENV`, with `python_path` on
    `PYTHONPATH` if given; its output, asserting it exited 0 (the output's tail in the
    failure)."""
    env = {**RUN_ENV, "PYTHONPATH": python_path} if python_path else RUN_ENV
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def run_all_ok(cmds: list[list[str]], cwd: Path = ROOT) -> list[str]:
    """`run_ok` of each command, all started at once (a 2-core machine runs two one-thread
    runs side by side in about the time of one); their outputs, asserting each exited 0."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=RUN_ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-4000:]
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def metric_rows(run_dir: Path, kind: str) -> list[dict]:
    """The rows of `kind` in `run_dir/metrics.jsonl`, in order (none before the file exists)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    return [r for r in rows if r["kind"] == kind]


def saved_rollouts(run_dir: Path) -> list[dict]:
    """Every rollout a run saved (`logging.rollouts_every`), in step order."""
    return [r for f in sorted((run_dir / "rollouts").glob("step_*.jsonl"))
            for g in f.read_text().splitlines() for r in json.loads(g)["rollouts"]]
