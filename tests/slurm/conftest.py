"""Fixtures for the Slurm tests: a real Slurm cluster (`slurmcluster.SlurmCluster`) on the
network-namespace hosts of tests/multihost (`netns.Hosts`).

Slurm and munge are installed with apt-get when missing (as root on Debian, like `.ci/run`);
the tests skip, with the reason, only where namespaces cannot be made (not root, no `ip`, not
permitted). Where they can but Slurm cannot be installed, they fail saying why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multihost"))

from netns import Hosts, unavailable
from slurmcluster import SlurmCluster, install


@pytest.fixture(scope="session")
def slurm_ok() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"slurm harness: {reason}")
    why = install()
    if why:
        pytest.fail(f"slurm harness: cannot install Slurm: {why}")


@pytest.fixture(scope="module")
def slurm(slurm_ok):
    """Nodes n0, n1, n2 on hosts 198.18.0.1-3, slurmctld on n0; torn down whatever happens."""
    with Hosts(3) as net, SlurmCluster(net) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def prepared_model(slurm_ok, tmp_path_factory):
    """tests/multihost's tiny model that makes tool calls when sampling."""
    from cluster import prepare_model

    return prepare_model(tmp_path_factory.mktemp("prep"))
