"""Checkpoints: round trip of trainer + RNG + loop state, keep-last-K, atomic under crashes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.config import AlgorithmSection, TorchTrainerConfig
from asyncrl.errors import CheckpointError
from asyncrl.trainer.torch_trainer import TorchTrainer

EXAMPLES = [([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1]), ([11, 12, 13, 14], [0, 1, 1, 1])]


class FileTrainer:
    """Stands in for a trainer: its state is one small file."""

    def __init__(self, payload: bytes = b"weights") -> None:
        self.payload = payload
        self.loaded: bytes | None = None

    def save_state(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "w.bin").write_bytes(self.payload)

    def load_state(self, path):
        self.loaded = (Path(path) / "w.bin").read_bytes()


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_round_trip_of_model_optimizer_schedule_rng_and_state(tmp_path, tiny_model_factory):
    torch.set_num_threads(1)

    def trainer(seed):
        return TorchTrainer(tiny_model_factory(seed), TorchTrainerConfig(),
                            AlgorithmSection(lr=1e-3, warmup_steps=3), pad_token_id=0)

    tr = trainer(0)
    tr.sft_step(EXAMPLES)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    loop_rng = random.Random(3)
    loop_rng.random()
    state = {"step": 1, "stage": "s1", "policy_version": 4,
             "data_cursor": {"epoch": 0, "index": 17}, "rng_state": loop_rng.getstate()}
    save_checkpoint(tmp_path, 1, tr, state)
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())
    tr.sft_step(EXAMPLES)
    tr.sft_step(EXAMPLES)
    expected = _params(tr.model)

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    other = trainer(7)
    got = load_checkpoint(latest_checkpoint(tmp_path), other)
    assert got == state
    restored = random.Random()
    restored.setstate(got["rng_state"])
    assert restored.random() == loop_rng.random()
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == draws
    assert other.optimizer_step == 1
    other.sft_step(EXAMPLES)
    other.sft_step(EXAMPLES)
    for k, v in _params(other.model).items():
        assert torch.equal(v, expected[k]), k


def test_keep_last_k(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, FileTrainer(f"w{step}".encode()), {"step": step},
                        keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["step_00000004", "step_00000005"]
    tr = FileTrainer()
    assert load_checkpoint(latest_checkpoint(tmp_path), tr) == {"step": 5}
    assert tr.loaded == b"w5"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, FileTrainer(b"old"), {"v": 1})
    save_checkpoint(tmp_path, 3, FileTrainer(b"new"), {"v": 2})
    tr = FileTrainer()
    assert load_checkpoint(latest_checkpoint(tmp_path), tr) == {"v": 2}
    assert tr.loaded == b"new"
    assert len(list_checkpoints(tmp_path)) == 1


def test_exception_during_save_leaves_no_partial_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, FileTrainer(), {"step": 1})

    class Exploding(FileTrainer):
        def save_state(self, path):
            super().save_state(path)
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(tmp_path, 2, Exploding(), {"step": 2})
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, 3, FileTrainer(), {"unpicklable": lambda: 0})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert load_checkpoint(latest_checkpoint(tmp_path)) == {"step": 1}


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from asyncrl.checkpoint import save_checkpoint

class Slow:
    def save_state(self, path):
        Path(path).mkdir(parents=True)
        with open(Path(path) / "w.bin", "wb") as f:
            f.write(b"x" * 1_000_000)
            f.flush()
            Path(sys.argv[2]).write_text("half written")
            time.sleep(120)
            f.write(b"never")

save_checkpoint(sys.argv[1], 2, Slow(), {"step": 2})
"""


@pytest.mark.timeout(120)
def test_process_killed_mid_write_never_exposes_a_half_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, FileTrainer(b"good"), {"step": 1})
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(flag)])
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "writer never started writing"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / ".tmp-step_00000002").is_dir()          # the half-written attempt
    assert not (ckpts / "step_00000002").exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    tr = FileTrainer()
    assert load_checkpoint(latest_checkpoint(tmp_path), tr) == {"step": 1}
    assert tr.loaded == b"good"
    # the next save succeeds and clears the debris
    save_checkpoint(tmp_path, 2, FileTrainer(b"retry"), {"step": 2})
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]


def test_incomplete_directories_are_ignored(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, None, {"step": 1})
    (tmp_path / "checkpoints" / "step_00000009").mkdir()       # e.g. a copy in progress
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000009")


def test_sft_checkpoints_have_their_own_names_and_the_newest_is_by_order(tmp_path):
    # the RL step does not move during SFT: named by it, every SFT save replaced the last
    for stage_step in (200, 400, 600):
        save_checkpoint(tmp_path, 0, FileTrainer(f"s{stage_step}".encode()), {"s": stage_step},
                        name=f"sft_00_{stage_step:08d}", order=(0, 0, stage_step), keep_last=2)
    names = [p.name for _, p in list_checkpoints(tmp_path)]
    assert names == ["sft_00_00000400", "sft_00_00000600"]
    save_checkpoint(tmp_path, 1, FileTrainer(b"rl1"), {"s": "rl"}, order=(1, 1, 1), keep_last=2)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["sft_00_00000600",
                                                                 "step_00000001"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(ValueError, match="not a checkpoint name"):
        save_checkpoint(tmp_path, 2, FileTrainer(), {}, name="../escape")


def test_a_save_killed_while_replacing_a_checkpoint_leaves_the_old_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 3, FileTrainer(b"old"), {"v": 1})
    real_rename = os.rename

    def killed_at_the_final_rename(src, dst, *a, **k):
        if Path(src).name.startswith(".tmp-"):
            raise SystemExit("killed")  # the process dies here
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", killed_at_the_final_rename)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 3, FileTrainer(b"new"), {"v": 2})
    monkeypatch.setattr(os, "rename", real_rename)
    tr = FileTrainer()
    assert load_checkpoint(latest_checkpoint(tmp_path), tr) == {"v": 2}  # swapped in whole
    assert tr.loaded == b"new"


def test_resume_names_every_unreadable_checkpoint_and_refuses_when_none_loads(tmp_path):
    from asyncrl.checkpoint import load_newest

    assert load_newest(tmp_path, None, dict) is None   # no checkpoint at all: a new run
    for step in (4, 6):
        save_checkpoint(tmp_path, step, FileTrainer(f"w{step}".encode()), {"step": step})
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_00000006" / "meta.json").write_text("")   # a disk fault in the newest
    tr = FileTrainer()
    path, state = load_newest(tmp_path, tr, dict)
    assert path.name == "step_00000004" and state == {"step": 4} and tr.loaded == b"w4"
    (ckpts / "step_00000004" / "state.pkl").write_bytes(b"\x80\x04 cut short")
    # checkpoints exist but none loads: a refusal naming each, never a restart from step 1
    with pytest.raises(CheckpointError, match=r"step_00000004: .*step_00000006: no readable|"
                       r"step_00000006: no readable.*step_00000004"):
        load_newest(tmp_path, FileTrainer(), dict)
    for d in ckpts.iterdir():
        (d / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="refusing to restart"):
        load_newest(tmp_path, FileTrainer(), dict)


def test_resume_logs_each_unreadable_checkpoint(tmp_path):
    import structlog

    from asyncrl.checkpoint import load_newest

    for step in (1, 2):
        save_checkpoint(tmp_path, step, None, {"step": step})
    (tmp_path / "checkpoints" / "step_00000002" / "meta.json").write_text("{")
    with structlog.testing.capture_logs() as logs:
        path, _ = load_newest(tmp_path, None, dict)
    assert path.name == "step_00000001"
    bad = [e for e in logs if e["event"] == "checkpoint_unreadable"]
    assert [Path(e["checkpoint"]).name for e in bad] == ["step_00000002"]
    assert bad[0]["log_level"] == "warning"


def test_a_replacement_without_atomic_exchange_never_leaves_none(tmp_path, monkeypatch):
    # NFS and its kind refuse renameat2's exchange: the save replaces in steps
    import asyncrl.checkpoint as ck

    monkeypatch.setattr(ck, "_exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 3, FileTrainer(b"old"), {"v": 1})
    real_rename = os.rename

    def killed_at_the_final_rename(src, dst, *a, **k):
        if Path(src).name.startswith(".tmp-"):
            raise SystemExit("killed")  # the process dies between the two steps
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", killed_at_the_final_rename)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 3, FileTrainer(b"new"), {"v": 2})
    monkeypatch.setattr(os, "rename", real_rename)
    tr = FileTrainer()
    assert load_checkpoint(latest_checkpoint(tmp_path), tr) == {"v": 1}  # the old one, whole
    assert tr.loaded == b"old"
    # the next save puts it back under its name, then replaces it
    save_checkpoint(tmp_path, 3, FileTrainer(b"again"), {"v": 3})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]
    assert load_checkpoint(latest_checkpoint(tmp_path)) == {"v": 3}
