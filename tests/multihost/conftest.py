"""Fixtures for the multi-host tests: hosts in network namespaces on one machine (`netns.py`).

They skip, with the reason, where namespaces cannot be made (not root, no `ip`, not
permitted); CI runs as root, so there they run.
"""

from __future__ import annotations

import pytest
from netns import Hosts, unavailable


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host harness: {reason}")


@pytest.fixture
def hosts(netns_ok):
    """Two hosts, 198.18.0.1 and 198.18.0.2, removed after the test whatever happens."""
    with Hosts(2) as net:
        yield net


@pytest.fixture(scope="session")
def prepared_model(netns_ok, tmp_path_factory):
    """A tiny model that makes tool calls when sampling (`cluster.prepare_model`), shared by
    the slow runs."""
    from cluster import prepare_model

    return prepare_model(tmp_path_factory.mktemp("prep"))
