"""Submitting tools/slurm/asyncrl.sbatch to the test cluster, and reading what its runs wrote.

The config is tests/multihost's micro curriculum (`cluster.micro_config`: the Megatron
trainer, tensor parallel 2, a prepared 2-layer Qwen3, 20 SFT steps then RL); the sandbox URLs
and token file are the job's own (the script sets them). Greedy rollouts unless asked: two
runs then roll out the same sequences and can be compared step by step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from cluster import ROOT, micro_config, rows
from slurmcluster import SlurmCluster

SBATCH = ROOT / "tools" / "slurm" / "asyncrl.sbatch"
COMPARED = ("sft/loss", "sft/grad_norm", "train/loss", "train/entropy", "train/mismatch_abs",
            "reward/mean", "rollout/tool_calls_mean", "rollout/response_tokens_mean")


def config(path: Path, model: Path, *, rl_steps: int, temperature: float = 0.0) -> Path:
    """The micro curriculum with a remote sandbox whose URLs the job fills in. Its rollouts
    call the tool, whose outputs show no measured time (`rollout.tool_time = "none"`), so two
    greedy runs roll out the same tokens and compare step by step."""
    return micro_config(path, model=model, sandbox_urls=[], token_file=Path("/nonexistent"),
                        rl_steps=rl_steps, temperature=temperature)


def submit(slurm: SlurmCluster, cfg: Path, run_dir: Path, out: Path, *, nodes: int = 3,
           trainer_nodes: int = 2, gpus_per_node: int = 1, args: tuple[str, ...] = (),
           sbatch_args: tuple[str, ...] = ()) -> str:
    """`RUN_DIR=run_dir sbatch tools/slurm/asyncrl.sbatch cfg ARGS` from the checkout;
    returns the job id. One thread per rank, one sandbox worker: the machine is shared."""
    env = {"RUN_DIR": str(run_dir), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "TRAINER_NODES": str(trainer_nodes), "SANDBOX_NODES": "1",
           "GPUS_PER_NODE": str(gpus_per_node), "SANDBOX_WORKERS": "1",
           "SANDBOX_ARGS": "--isolation seccomp --preload math", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "WAIT_S": "120"}
    return slurm.sbatch([f"--nodes={nodes}", f"--output={out}", *sbatch_args, str(SBATCH),
                         str(cfg), "--set", "logging.console=json", *args], env=env, cwd=ROOT)


def per_step(run_dir: Path) -> list[dict[str, Any]]:
    """The compared metrics of every SFT and RL step row, in order."""
    return [{"kind": r["kind"], "step": r.get("sft_step", r["step"]),
             **{k: r[k] for k in COMPARED if k in r}}
            for r in rows(run_dir, "sft_step") + rows(run_dir, "rl_step")]


def log_lines(out: Path, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of `event` in a job's output."""
    found = []
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def wait_for_rl_step(run_dir: Path, step: int, timeout: float, out: Path) -> None:
    """Block until RL step `step` is in the run's metrics."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in rows(run_dir, "rl_step")):
            return
        time.sleep(0.2)
    tail = out.read_text(errors="replace")[-4000:] if out.exists() else ""
    raise AssertionError(f"no RL step {step} after {timeout}s: {tail}")
