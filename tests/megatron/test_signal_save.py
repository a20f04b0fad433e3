"""Under torchrun a SIGTERM reaches every rank: the followers must outlive it until rank 0's
stop checkpoint, a `save_state` call announced like any other, has their shards
(`asyncrl.trainer.megatron.launch`, `asyncrl.stopping`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.checkpoint import latest_checkpoint, load_checkpoint

WORKER = Path(__file__).with_name("signal_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~40 s: two Megatron processes on the CPU
@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_saves_every_ranks_shard(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from mg_cases import hf_model

    hf_model("qwen3").save_pretrained(tmp_path / "init")
    # the worker runs as a script: this checkout's asyncrl first, not whichever is installed
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(WORKER), str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stdout.read()[-4000:] if proc.stdout else "")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    out, _ = proc.communicate(timeout=120)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None, out[-4000:]
    assert load_checkpoint(ckpt, restore_rng=False) == {"stopped_by": "SIGTERM"}
    shards = sorted(p.name for p in (ckpt / "trainer").iterdir())
    assert shards == ["megatron_tp00.pt", "megatron_tp01.pt"], out[-4000:]  # both ranks wrote
    assert "follower_signal_deferred" in out and "follower_done" in out
