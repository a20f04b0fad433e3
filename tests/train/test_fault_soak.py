"""Fault soak: the tiny curriculum loses nothing to killed workers or a power cut (slow).

    python -m pytest -m slow tests/train/test_fault_soak.py

`asyncrl train curricula/tiny.toml` in its own process group. Once RL runs, random processes
of the run's tree (sandbox jails, zygotes, templates, calls, reward hosts) are SIGKILLed every
few seconds; at RL step 14 the whole process group is SIGKILLed at once (a power cut of the
run; the sandbox's workers live in their own sessions and must die with it). Then
`--resume`. It must: leave no process behind, start at the last checkpoint + 1 (not at step 1,
and not at a checkpoint it skipped), apply every step's update once (the trainer's optimizer
step count is the SFT steps plus one per RL step that trained), and still reach the accuracy
the tiny run reaches unharmed. About 8 minutes on an idle 2-core machine; longer when shared.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_tree import alive, descendants, started

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (run_dir.parent / f"{run_dir.name}{'-resume' if extra else ''}.out").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli.main", "train", "curricula/tiny.toml", "--run-dir",
         str(run_dir), *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)


def _note(seen: dict[int, int], pids: list[int]) -> None:
    for pid in pids:
        if pid not in seen and (t := started(pid)) is not None:
            seen[pid] = t


def test_the_tiny_run_survives_killed_workers_and_a_power_cut(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(run)
    rng = random.Random(0)
    killed: list[int] = []
    seen: dict[int, int] = {}  # pid -> its start time: a later process given the pid is not ours
    last_kill = 0.0
    deadline = time.monotonic() + 3000
    while True:
        assert time.monotonic() < deadline, "the run did not reach RL step 14"
        assert proc.poll() is None, (tmp_path / "run.out").read_text()[-3000:]
        steps = [r["step"] for r in _rows(run) if r["kind"] == "rl_step"]
        tree = descendants(proc.pid)
        _note(seen, tree)
        if steps and steps[-1] >= 14:
            break
        if steps and len(killed) < 13 and time.monotonic() - last_kill > 3 and tree:
            victim = rng.choice(tree)
            try:
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
            except ProcessLookupError:
                pass
            last_kill = time.monotonic()
        time.sleep(0.5)
    _note(seen, descendants(proc.pid))
    os.killpg(proc.pid, signal.SIGKILL)  # the power cut
    proc.wait()
    assert len(killed) >= 8
    t0 = time.monotonic()
    while [p for p, t in seen.items() if alive(p, t)] and time.monotonic() - t0 < 20:
        time.sleep(0.5)
    assert not [p for p, t in seen.items() if alive(p, t)], "processes outlived the run"

    from asyncrl.checkpoint import list_checkpoints
    from asyncrl.observe.report import load_metrics

    last = list_checkpoints(run)[-1][0]
    assert 10 <= last < 14
    resume = _train(run, "--resume")
    assert resume.wait(timeout=3000) == 0, (tmp_path / "run-resume.out").read_text()[-3000:]

    rows = _rows(run)
    (at,) = [i for i, r in enumerate(rows) if r["kind"] == "resumed"]
    assert rows[at]["step"] == last  # the last checkpoint, not step 1, not an older one
    assert next(r["step"] for r in rows[at:] if r["kind"] == "rl_step") == last + 1
    assert not [r for r in rows[at:] if r["kind"] == "sft_step"]
    log = (run / "log.jsonl").read_text()
    assert log.count('"sandbox_worker_replaced"') >= 1  # workers really were killed mid-run

    kept = load_metrics(run / "metrics.jsonl")
    rl = [r for r in kept if r["kind"] == "rl_step"]
    from asyncrl import config

    stages = config.load(ROOT / "curricula" / "tiny.toml").stages
    rl_steps = sum(st.steps for st in stages if st.kind == "rl")
    assert [r["step"] for r in rl] == list(range(1, rl_steps + 1))  # each step once
    sft_steps = sum(st.steps for st in stages if st.kind == "sft")
    trained = [r for r in rl if "train/optimizer_step" in r]
    assert trained[-1]["train/optimizer_step"] == sft_steps + len(trained)  # each update once
    final = next(r for r in kept if r["kind"] == "eval" and r["label"] == "final")
    assert final["eval/accuracy"] >= 0.9
