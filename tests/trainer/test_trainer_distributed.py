"""Two CPU processes under torchrun (gloo) train exactly like one process on the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import BATCH_SEED, BUDGET, run
from trainer_batches import rl_batch

from asyncrl.algo import batching

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def reference():
    old = torch.get_num_threads()
    try:
        return run("none")
    finally:
        torch.set_num_threads(old)


def test_batch_makes_ranks_pack_unequal_micro_batch_counts():
    seqs = batching.sequences_from_batch(rl_batch(BATCH_SEED, groups=3, per_group=4))
    for mini in batching.split_minibatches(seqs, 2):
        lengths = [s.num_tokens for s in mini]
        counts = [len(batching.pack([mini[i] for i in batching.shard(lengths, r, 2)], BUDGET))
                  for r in range(2)]
        assert counts[0] != counts[1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_two_ranks_equal_single_process(parallel, reference, tmp_path):
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(HERE / "dist_worker.py"), str(out), parallel, str(tmp_path)],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert got["world"] == 2
    assert got["sharded"] == (parallel == "fsdp2")
    assert len(got["grads"]) == len(reference["grads"]) == 5    # 2 RL steps x 2 + 1 SFT
    for ref_step, got_step in zip(reference["grads"], got["grads"], strict=True):
        for k, v in ref_step.items():
            torch.testing.assert_close(got_step[k], v, atol=1e-7, rtol=1e-4, msg=k)
    for k, v in reference["params"].items():
        torch.testing.assert_close(got["params"][k], v, atol=1e-5, rtol=1e-5, msg=k)
    for ref_m, got_m in zip(reference["metrics"], got["metrics"], strict=True):
        for k in ("train/loss", "train/tokens", "train/entropy", "train/grad_norm",
                  "train/ratio_max", "train/mismatch_abs", "sft/loss", "sft/tokens",
                  # the step's quantiles, both ranks' tokens gathered (each rank's own differ)
                  "train/mismatch_ratio_p01", "train/mismatch_ratio_p50",
                  "train/mismatch_ratio_p99"):
            if k in ref_m:
                assert got_m[k] == pytest.approx(ref_m[k], rel=1e-5, abs=1e-7), k
    assert got["sync_keys"] == reference["sync_keys"]
    assert got["replay_max_diff"] == 0.0               # save_state/load_state under sharding
    from asyncrl.modeling import load_model

    exported = dict(load_model(tmp_path / "hf").named_parameters())
    for k, v in got["params"].items():
        torch.testing.assert_close(exported[k].detach(), v, msg=k)
