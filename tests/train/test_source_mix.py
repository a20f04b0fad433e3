"""`[[stages]] source_weights` through `asyncrl train`: a stage trains only on the sources it
names (a hard filter samples only those), its metrics row counts them, and a key that names
no source of the training set stops the run when the problems are read, before a model is
built. (The plan's line for a generator source: tests/tasks/test_rgym.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from micro_config import MICRO_ENGINE, MICRO_MODEL, ROOT, RUN_ENV, metric_rows, micro_rollout


def _curriculum(tmp_path: Path, weights: str, extra: list[dict] | None = None) -> Path:
    rows = [{"id": f"add-{i}", "question": f"{i} + 2 =", "answer": str(i + 2),
             "source": "arith/add"} for i in range(12)]
    rows += extra or []
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
name = "mix"
steps = 2
source_weights = {weights}
[[stages]]
name = "hard-add"
steps = 1
source_weights = {{ add = 1 }}
data_filter = "hard"
hard_filter_k = 2
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
    cfg = _curriculum(tmp_path, '{ add = 1, mul = 1 }')
    run = tmp_path / "run"
    proc = _train(cfg, run)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    starts = {r["stage"]: r for r in metric_rows(run, "stage") if r["event"] == "start"}
    assert starts["all"]["by_source"] == {"arith/add": 12, "arith/mul": 36}
    assert starts["mix"]["by_source"] == {"arith/add": 12, "arith/mul": 12}
    (hard,) = metric_rows(run, "hard_filter")
    assert hard["problems"] == 12  # the filter sampled the stage's mix, not all 48
    steps: dict[str, list[str]] = {}
    for r in metric_rows(run, "rl_step"):
        steps.setdefault(r["stage"], []).extend(r["problem_ids"])
    assert [len(v) for v in steps.values()] == [2, 4, 2]
    mixed = {p.split("-")[0] for p in steps["mix"]}
    assert mixed <= {"add", "mul"}
    assert all(p.startswith("add-") for p in steps["hard-add"])


def test_a_mix_naming_no_source_stops_the_run_before_its_first_stage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(_curriculum(tmp_path, '{ add = 1, sub = 1 }'), run)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "stages[1].source_weights" in out and "['sub'] name no source" in out, out[-3000:]
    assert "arith/add" in out and "arith/mul" in out  # the sources it has
    assert metric_rows(run, "rl_step") == []  # the first stage, which names none, never ran
    # found when the problems were read: no model was built, no engine or sandbox started
    assert not (run / "model-init").exists() and not (run / "prompt.json").exists()
    assert "model_built" not in out and "runtime_ready" not in out


def test_a_mix_naming_a_source_whose_prompts_are_all_too_long_stops_before_training(
        tmp_path: Path) -> None:
    """The prompt-length filter can empty a source the file has: the check runs again on what
    it left, before the first stage, not when the stage that names the source starts."""
    long = [{"id": f"long-{i}", "question": " + ".join(["9"] * 300) + " =", "answer": "2700",
             "source": "arith/long"} for i in range(3)]
    run = tmp_path / "run"
    proc = _train(_curriculum(tmp_path, "{ add = 1, long = 1 }", long), run)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "stages[1].source_weights" in out and "['long'] name no source" in out, out[-3000:]
    assert "overlong" in out or "overlong_skipped" in (run / "metrics.jsonl").read_text()
    assert metric_rows(run, "rl_step") == []  # the first stage never ran
