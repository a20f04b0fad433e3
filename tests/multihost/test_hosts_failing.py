"""Hosts failing mid-run (network namespaces on this machine, as in test_multinode_train.py):

- the sandbox host's link is cut: tool calls go to the other sandbox node; with every sandbox
  host cut they are recorded as `sandbox_failure` tool results, and the run goes on;
- a follower rank is killed: the run stops with an error naming the rank and its host, and
  the same launch with `--resume` finishes from the last checkpoint.

Slow: `python -m pytest -m slow tests/multihost/test_hosts_failing.py`.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from cluster import (
    launch,
    micro_config,
    rows,
    sandbox_node,
    tool_statuses,
    train,
    wait_all,
    wait_for_step,
    worker_pids,
)
from netns import Hosts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_cut_sandbox_hosts_fail_over_then_become_tool_errors(netns_ok, prepared_model, tmp_path):
    with Hosts(3) as net:
        token = tmp_path / "sandbox.token"
        urls = [sandbox_node(net, 1, token), sandbox_node(net, 2, token)]
        cfg = micro_config(tmp_path / "run.toml", model=prepared_model, sandbox_urls=urls,
                           token_file=token, tensor_parallel=1, rl_steps=7, temperature=1.0)
        run_dir, log = tmp_path / "run", tmp_path / "run.log"
        proc = train(net, 0, cfg, log, ["--run-dir", str(run_dir), "--set",
                                        "logging.console=json", "--set",
                                        "logging.rollouts_every=1"])
        wait_for_step(run_dir, 1, [proc], 300)
        net.link(1, up=False)   # steps >= 3 are rolled out after this (on-policy: one ahead)
        wait_for_step(run_dir, 4, [proc], 300)
        net.link(2, up=False)   # steps >= 6: no sandbox host left
        assert wait_all({"run": proc}, {"run": log}, 400) == {"run": 0}, log.read_text()[-3000:]

    assert [r["step"] for r in rows(run_dir, "rl_step")] == list(range(1, 8))
    # Host 1 cut: host 2 answers (ok, or the model's own error). Calls caught on host 1 at the
    # cut move to host 2 after the client's stall timeout (test_sandbox_link_cut.py measures
    # that); a call may still end as `sandbox_failure` if its deadline runs out first.
    failed_over = tool_statuses(run_dir, 3) + tool_statuses(run_dir, 4) + tool_statuses(run_dir, 5)
    assert {"ok", "error"} & set(failed_over)
    cut_off = tool_statuses(run_dir, 6) + tool_statuses(run_dir, 7)
    assert cut_off and set(cut_off) == {"sandbox_failure"}


def test_a_killed_follower_stops_the_run_naming_it_and_resume_finishes(hosts, prepared_model,
                                                                       tmp_path):
    token = tmp_path / "sandbox.token"
    url = sandbox_node(hosts, 1, token)
    cfg = micro_config(tmp_path / "run.toml", model=prepared_model, sandbox_urls=[url],
                       token_file=token, rl_steps=6, temperature=1.0)
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), "--set", "logging.console=json",
            "--set", "checkpoint.every_steps=2"]

    def start(tag: str, extra: list[str]) -> tuple[dict, dict]:
        logs = {f"node{i}": tmp_path / f"{tag}-node{i}.log" for i in range(2)}
        procs = {f"node{i}": launch(hosts, i, nnodes=2, node_rank=i, nproc=1, config=cfg,
                                    log=logs[f"node{i}"], args=args + extra) for i in range(2)}
        return procs, logs

    procs, logs = start("first", [])
    wait_for_step(run_dir, 3, list(procs.values()), 300)
    (follower,) = worker_pids(hosts, 1)
    os.kill(follower, signal.SIGKILL)
    codes = wait_all(procs, logs, 300)
    assert codes["node0"] != 0 and codes["node1"] != 0
    head = logs["node0"].read_text()
    assert "error: trainer call" in head and "rank 1 on 198.18.0.2" in head, head[-3000:]
    assert "--resume" in head
    done = [r["step"] for r in rows(run_dir, "rl_step")]
    assert 3 <= max(done) < 6

    procs, logs = start("resumed", ["--resume"])
    assert wait_all(procs, logs, 300) == {"node0": 0, "node1": 0}, logs["node0"].read_text()[-3000:]
    resumed = [json.loads(x) for x in logs["node0"].read_text().splitlines()
               if x.startswith("{") and '"resumed"' in x]
    assert [r["step"] for r in resumed] == [max(done) // 2 * 2]  # the last checkpoint
    steps = [r["step"] for r in rows(run_dir, "rl_step")]
    assert steps[-(6 - resumed[0]["step"]):] == list(range(resumed[0]["step"] + 1, 7))
