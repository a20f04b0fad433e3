"""`[[stages]] source_weights` through `asyncrl train`: a stage trains only on the sources it
names, and a key that names no source of the training set stops the run before any stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from micro_config import MICRO_ENGINE, MICRO_MODEL, ROOT, RUN_ENV, metric_rows, micro_rollout


def _curriculum(tmp_path: Path, weights: str) -> Path:
    rows = [{"id": f"add-{i}", "question": f"{i} + 2 =", "answer": str(i + 2),
             "source": "arith/add"} for i in range(12)]
    rows += [{"id": f"mul-{i}", "question": f"{i} * 3 =", "answer": str(i * 3),
              "source": "arith/mul"} for i in range(36)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "mix.toml"
    cfg.write_text(f"""
[run]
name = "mix"
seed = 1
{MICRO_MODEL}
[data]
train = "{data}"
max_prompt_tokens = 256
{micro_rollout()}{MICRO_ENGINE}
[[stages]]
name = "all"
steps = 1
[[stages]]
name = "add-only"
steps = 3
source_weights = {weights}
[eval]
every_steps = 0
[checkpoint]
every_steps = 0
[logging]
console = "json"
""")
    return cfg


def _train(cfg: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg),
                           "--run-dir", str(run_dir)], cwd=ROOT, env=RUN_ENV,
                          capture_output=True, text=True, timeout=600)


def test_a_stage_trains_only_on_the_sources_it_names(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(_curriculum(tmp_path, '{ add = 1 }'), run)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = {r["stage"]: [] for r in metric_rows(run, "rl_step")}
    for r in metric_rows(run, "rl_step"):
        steps[r["stage"]] += r["problem_ids"]
    assert len(steps["add-only"]) == 3 * 2
    assert all(p.startswith("add-") for p in steps["add-only"])
    assert len(steps["all"]) == 2  # the stage before it draws from the whole set


def test_a_mix_naming_no_source_stops_the_run_before_its_first_stage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(_curriculum(tmp_path, '{ add = 1, sub = 1 }'), run)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "stages[1].source_weights" in out and "['sub'] name no source" in out, out[-3000:]
    assert "arith/add" in out and "arith/mul" in out  # the sources it has
    assert metric_rows(run, "rl_step") == []  # the first stage, which names none, never ran
