"""The harness itself: three nodes register, each job step runs on its node (its own
hostname and 198.18.0.x address), and nothing (daemon, namespace, directory) outlives the cluster."""

from __future__ import annotations

import subprocess

import pytest
from netns import Hosts, our_namespaces
from slurmcluster import SlurmCluster

pytestmark = pytest.mark.timeout(180)


def test_three_nodes_run_steps_each_on_its_own_host(slurm_ok):
    with Hosts(3) as net, SlurmCluster(net) as slurm:
        prefix, where = net.prefix, slurm.dir
        assert slurm.sinfo().split() == ["n0", "idle", "n1", "idle", "n2", "idle"]
        out = slurm.run(["srun", "-N3", "-l", "sh", "-c",
                         'echo "$(hostname) $(hostname -I) $SLURM_NODEID"'], timeout=60).stdout
        got = sorted(line.split(": ", 1)[1].split() for line in out.splitlines())
        assert got == [["n0", "198.18.0.1", "0"], ["n1", "198.18.0.2", "1"],
                       ["n2", "198.18.0.3", "2"]]
        # a step on a subset of the nodes numbers them from 0 (trainer_node.sh's NODE_RANK)
        out = slurm.run(["srun", "-N2", "-w", "n1,n2", "-l", "sh", "-c",
                         'echo "$(hostname) $SLURM_NODEID $SLURM_STEP_NUM_NODES"'],
                        timeout=60).stdout
        assert sorted(line.split(": ", 1)[1] for line in out.splitlines()) == ["n1 0 2", "n2 1 2"]

    assert not our_namespaces(prefix)
    assert not where.exists()
    left = subprocess.run(["pgrep", "-f", str(where)], capture_output=True, text=True).stdout
    assert not left.strip(), left
