"""What a user sees of a real micro run on a terminal: `asyncrl train` in a pseudo-terminal
shows the live progress display with log lines above it, TensorBoard's reader finds every
metric of `metrics.jsonl`, the W&B offline run holds them, and the trajectory viewer has the
RL waves with RoC's decisions. Also: a second run of a config numbers a new directory and says
so, and `--run-dir` / `--resume` keep their rules."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from micro_config import MICRO_ENGINE, MICRO_MODEL, micro_rollout

from asyncrl import config
from asyncrl.errors import CheckpointError
from asyncrl.observe.sinks import scalars
from asyncrl.rundir import pick_run_dir

ROOT = Path(__file__).resolve().parents[2]

MICRO = """
[run]
name = "micro"
seed = 5
""" + MICRO_MODEL + """[data]
train = "generator:tiny_math"
eval = "generator:tiny_math"
max_prompt_tokens = 256
[data.generator_options]
train_size = 32
eval_size = 4
levels = [1]
""" + micro_rollout() + MICRO_ENGINE + """[[stages]]
name = "sft"
kind = "sft"
steps = 10
batch_size = 2
[[stages]]
name = "rl"
steps = 3
[eval]
every_steps = 2
max_problems = 4
[checkpoint]
every_steps = 0
[logging]
sinks = ["tensorboard", "wandb"]
rollouts_every = 1
"""

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def _in_pty(args: list[str], timeout_s: float = 600) -> tuple[int, str]:
    """Run `args` with a pseudo-terminal (160 columns) as stdin, stdout and stderr; returns
    (exit code, everything it wrote)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child side is closed
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode, out.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("tty")
    cfg = tmp / "micro.toml"
    cfg.write_text(MICRO)
    run_dir = tmp / "run"
    rc, out = _in_pty([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
                       str(run_dir)])
    assert rc == 0, out[-4000:]
    return run_dir, ANSI.sub("", out)


@pytest.mark.timeout(600)
def test_a_terminal_shows_the_progress_display_with_logs_above(tty_run: tuple[Path, str]
                                                              ) -> None:
    _, out = tty_run
    assert "new run in" in out.splitlines()[0]
    assert "stage 1/2 sft (sft)" in out and "SFT loss" in out
    assert re.search(r"stage 2/2 rl \(rl\)\s+step 3/3\s+ETA stage 0s", out), out[-3000:]
    assert re.search(r"held-out accuracy \d+\.\d% \(step \d\)", out)
    assert re.search(r"rollouts \d+ done / \d+ in flight\s+tool calls \d+\.\d/s", out)
    assert "sandbox errors" in out
    # log lines keep flowing (the readable console renderer on a terminal)
    assert re.search(r"\[info\s*\]\s+rl_step", out) and "run_done" in out
    assert "trajectory viewer:" in out


@pytest.mark.timeout(600)
def test_every_metric_reaches_tensorboard_and_wandb(tty_run: tuple[Path, str],
                                                    wandb_records: Any) -> None:
    run_dir, _ = tty_run
    from tensorboard.backend.event_processing import event_accumulator as ea

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want: dict[str, int] = {}
    for r in rows:
        for k in scalars(r)[1]:
            want[k] = want.get(k, 0) + 1
    assert {"reward/mean", "eval/accuracy", "sft/loss", "roc/rollouts_kept"} <= set(want)
    acc = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = {tag: len(acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
    assert got == want
    logged: dict[str, int] = {}
    for rec in wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_") and key not in ("step", "sft_step"):
                    logged[key] = logged.get(key, 0) + 1
    assert logged == want


@pytest.mark.timeout(600)
def test_the_viewer_has_the_rl_waves_with_roc_decisions(tty_run: tuple[Path, str]) -> None:
    run_dir, _ = tty_run
    from asyncrl.observe.viewer import load_sections

    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == [
        f"step_00000{i}.jsonl" for i in (1, 2, 3)]
    sections = load_sections(run_dir)
    rl = [s for s in sections if s["kind"] == "rl"]
    assert [s["step"] for s in rl] == [1, 2, 3]
    for s in rl:
        assert len(s["rollouts"]) == 2 * 4  # prompts x samples: the whole wave
        assert {r["roc"] for r in s["rollouts"]} <= {"kept", "dropped"}
        assert all(r["roc_why"] for r in s["rollouts"])
    page = (run_dir / "report" / "viewer.html").read_text()
    assert rl[0]["rollouts"][0]["id"] in page


# ------------------------------------------------------------------------- run directories
def _cfg(tmp_path: Path) -> config.RunConfig:
    cfg = config.from_dict({"run": {"name": "tiny", "output_dir": str(tmp_path)},
                            "model": {"init": {"model_type": "qwen3"}},
                            "data": {"train": "x.jsonl"}, "stages": [{"name": "rl", "steps": 1}]})
    return cfg


def _finish(d: Path) -> None:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"kind": "done"}\n')


def test_a_second_run_numbers_a_new_directory_and_says_so(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    rd, note = pick_run_dir(cfg, None, resume=False)
    assert rd == tmp_path / "tiny" and note == f"new run in {rd}"
    _finish(rd)
    rd2, note = pick_run_dir(cfg, None, resume=False)
    assert rd2 == tmp_path / "tiny-2"
    assert f"new run in {rd2}" in note and f"{rd} already holds a run" in note
    _finish(rd2)
    assert pick_run_dir(cfg, None, resume=False)[0] == tmp_path / "tiny-3"
    # --resume takes the newest
    os.utime(rd, (time.time() + 10, time.time() + 10))
    assert pick_run_dir(cfg, None, resume=True)[0] == rd


def test_resume_never_takes_another_configs_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)   # run.name "tiny"
    _finish(tmp_path / "tiny")
    for other in ("tiny2", "tiny-2b", "tinyx"):   # another curriculum's runs, all newer
        _finish(tmp_path / other)
        os.utime(tmp_path / other, (time.time() + 100, time.time() + 100))
    assert pick_run_dir(cfg, None, resume=True)[0] == tmp_path / "tiny"
    _finish(tmp_path / "tiny-7")
    os.utime(tmp_path / "tiny-7", (time.time() + 200, time.time() + 200))
    assert pick_run_dir(cfg, None, resume=True)[0] == tmp_path / "tiny-7"


def test_run_dir_and_resume_rules(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(CheckpointError, match="no run directory"):
        pick_run_dir(cfg, None, resume=True)
    given = tmp_path / "mine"
    assert pick_run_dir(cfg, str(given), resume=False) == (given, f"new run in {given}")
    with pytest.raises(CheckpointError, match="does not exist"):
        pick_run_dir(cfg, str(given), resume=True)
    _finish(given)
    with pytest.raises(CheckpointError, match="already holds a run: pass --resume"):
        pick_run_dir(cfg, str(given), resume=False)
    assert pick_run_dir(cfg, str(given), resume=True)[0] == given


def test_the_cli_refuses_to_reuse_a_finished_run_dir(tmp_path: Path) -> None:
    cfg = tmp_path / "micro.toml"
    cfg.write_text(MICRO)
    _finish(tmp_path / "done")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
                        str(tmp_path / "done")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1
    assert "already holds a run: pass --resume" in p.stderr
    assert (tmp_path / "done" / "metrics.jsonl").read_text() == '{"kind": "done"}\n'
