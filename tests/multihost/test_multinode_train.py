"""A real multi-node run on two hosts (network namespaces on this machine): the documented
`tools/launch_multinode.sh` on each host (torchrun, c10d rendezvous on the head's address,
`asyncrl.cli.launch`), the Megatron trainer over gloo with tensor parallel 2 — rank 0 on host
0, rank 1 on host 1 —, the orchestrator and the local engine on host 0, and the tools run by
an authenticated sandbox node (`asyncrl sandbox serve --host 198.18.0.2 --token-file ...`) on
host 1. Its per-step losses equal those of the same config run on one host.

Slow (a short SFT run prepares a model that makes tool calls, then two runs):
`python -m pytest -m slow tests/multihost/test_multinode_train.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster import assert_same_steps, launch, micro_config, rows, sandbox_node, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

COMPARED = ("sft/loss", "sft/grad_norm", "train/loss", "train/entropy", "train/mismatch_abs",
            "reward/mean", "rollout/tool_calls_mean", "rollout/response_tokens_mean")


def per_step(run_dir) -> list[dict[str, float]]:
    return [{k: r[k] for k in COMPARED if k in r}
            for r in rows(run_dir, "sft_step") + rows(run_dir, "rl_step")]


def step_rollouts(run_dir: Path, step: int) -> list[dict]:
    """The step's rollouts by id (a wave's groups are saved in the order they finished)."""
    lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return sorted((r for g in map(json.loads, lines) for r in g["rollouts"]),
                  key=lambda r: r["rollout_id"])


def test_two_host_run_equals_one_host_run(hosts, prepared_model, tmp_path):
    token = tmp_path / "sandbox.token"
    url = sandbox_node(hosts, 1, token)
    assert url == "http://198.18.0.2:8123"
    cfg = micro_config(tmp_path / "run.toml", model=prepared_model, sandbox_urls=[url],
                       token_file=token)

    # two hosts: one trainer rank on each
    two = tmp_path / "two"
    logs = {f"node{i}": tmp_path / f"two-node{i}.log" for i in range(2)}
    procs = {f"node{i}": launch(hosts, i, nnodes=2, node_rank=i, nproc=1, config=cfg,
                                log=logs[f"node{i}"],
                                args=["--run-dir", str(two), "--set", "logging.console=json"])
             for i in range(2)}
    assert wait_all(procs, logs, 300) == {"node0": 0, "node1": 0}, {
        k: v.read_text()[-3000:] for k, v in logs.items()}
    head, follower = logs["node0"].read_text(), logs["node1"].read_text()
    assert '"world_size": 2' in head and '"tp": 2' in head
    assert '"trainer_ranks"' in head and '"1": "198.18.0.2' in head  # rank 1 lived on host 1
    ready = [json.loads(x) for x in follower.splitlines() if '"follower_ready"' in x]
    assert ready and ready[0]["address"] == "198.18.0.2"  # rank 1 ran on host 1

    # one host, the same config: both ranks on host 0
    one = tmp_path / "one"
    log1 = {"node0": tmp_path / "one-node0.log"}
    p = launch(hosts, 0, nnodes=1, node_rank=0, nproc=2, config=cfg, log=log1["node0"],
               args=["--run-dir", str(one), "--set", "logging.console=json"])
    assert wait_all({"node0": p}, log1, 300) == {"node0": 0}, log1["node0"].read_text()[-3000:]

    got, want = per_step(two), per_step(one)
    assert len(got) == len(want) == 5  # SFT steps 10 and 20, then 3 RL steps
    # the SFT steps trained through both hosts: each row's loss is the mean over the ten
    # steps before it (one batch's alone rose from step 10 to 20, on one host too)
    assert all(r["sft/grad_norm"] > 0 for r in got[:2])
    assert got[1]["sft/loss"] < got[0]["sft/loss"]
    # Greedy rollouts whose tool outputs show no time (`rollout.tool_time = "none"`): both runs
    # roll out the same tokens, tool outputs included, so every figure must match and what
    # is compared is the trainer's forward and update across both hosts.
    assert any(r.get("rollout/tool_calls_mean", 0) > 0 for r in got)  # the tool was called
    for step in range(1, len(got) - 1):
        a, b = step_rollouts(two, step), step_rollouts(one, step)
        assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b], step
    assert_same_steps(got, want)
