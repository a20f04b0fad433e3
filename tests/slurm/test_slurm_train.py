"""The recipe under a real Slurm: `sbatch tools/slurm/asyncrl.sbatch` on a three-node cluster
(network-namespace hosts on this machine). Trainer nodes n0 and n1 (torchrun through
tools/launch_multinode.sh, the Megatron trainer over gloo, tensor parallel 2: rank 0 on n0,
rank 1 on n1) and the sandbox node n2, all job steps of one job; hostnames `n0`..`n2` resolve
to nothing, addresses come from the nodes. Its per-step losses equal those of the same recipe
on one trainer node (both ranks on n0, the sandbox on n1).

Greedy one-turn rollouts (`slurmrun.config`): the model reads each tool result's wall-clock
time, so runs that call the tool differ in those tokens; the sandbox node is started, found
and health-checked with the job's token here, and test_slurm_faults.py's sampled runs call it.

Slow: `python -m pytest -m slow tests/slurm/test_slurm_train.py`.
"""

from __future__ import annotations

import pytest
from cluster import assert_same_steps
from slurmrun import config, log_lines, per_step, submit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_two_trainer_nodes_and_a_sandbox_node_equal_one_trainer_node(slurm, prepared_model,
                                                                     tmp_path):
    cfg = config(tmp_path / "run.toml", prepared_model, rl_steps=3)
    two, out2 = tmp_path / "two", tmp_path / "two.out"
    job = submit(slurm, cfg, two, out2)
    assert slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 600, [out2]) \
        == "COMPLETED", out2.read_text()[-4000:]
    text = out2.read_text()
    assert "trainer nodes n0,n1, sandbox nodes n2" in text
    assert 'sandbox nodes up: ["http://198.18.0.3:8123"]' in text
    assert "head n0 at 198.18.0.1" in text
    (ranks,) = log_lines(out2, "trainer_ranks")
    assert ranks["ranks"]["1"].startswith("198.18.0.2 (n1)"), ranks  # rank 1 ran on n1
    (ready,) = log_lines(out2, "follower_ready")
    assert (ready["host"], ready["address"]) == ("n1", "198.18.0.2")
    # the sandbox node's token, made by the script, readable by its owner only
    assert (two / "slurm" / "sandbox.token").stat().st_mode & 0o077 == 0

    # one trainer node: both ranks on n0, sandbox on n1
    one, out1 = tmp_path / "one", tmp_path / "one.out"
    job = submit(slurm, cfg, one, out1, nodes=2, trainer_nodes=1, gpus_per_node=2)
    assert slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 600, [out1]) \
        == "COMPLETED", out1.read_text()[-4000:]
    assert "trainer nodes n0, sandbox nodes n1" in out1.read_text()

    got, want = per_step(two), per_step(one)
    assert [(r["kind"], r["step"]) for r in got] == [("sft_step", 10), ("sft_step", 20),
                                                     ("rl_step", 1), ("rl_step", 2),
                                                     ("rl_step", 3)]
    # the SFT steps trained: each row's loss is the mean over the ten steps before it
    assert all(r["sft/grad_norm"] > 0 for r in got[:2])
    assert got[1]["sft/loss"] < got[0]["sft/loss"]
    assert any(r.get("rollout/tool_calls_mean", 0) > 0 for r in got)  # runs with tool calls
    assert_same_steps(got, want)
