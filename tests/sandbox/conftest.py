"""Fixtures for the sandbox tests: one pool per isolation level, shared by the whole session.

Starting a pool costs a couple of seconds (zygotes import numpy and sympy), so the pools are
session-scoped; every adversarial test ends by checking that its pool still serves the next
call, which makes sharing them a stronger test, not a weaker one. Tests that use them run on
the session event loop (``pytestmark = pytest.mark.asyncio(loop_scope="session")``).
"""

from __future__ import annotations

import os

import pytest
import pytest_asyncio

from sandbox import PoolConfig, SandboxPool
from sandbox.config import IsolationLevel
from sandbox.errors import IsolationUnavailable
from sandbox.isolation import plan

# A host secret that must never be visible to sandboxed code. Set before any pool starts.
HOST_SECRET = "s3cr3t-host-value-7f2c"
os.environ["SANDBOX_TEST_HOST_SECRET"] = HOST_SECRET

FAST = dict(workers=2, time_limit_s=2.0, memory_mb=512, max_output_bytes=4096)


def _available(level: IsolationLevel) -> str:
    try:
        plan(PoolConfig(isolation=level))
        return ""
    except IsolationUnavailable as exc:
        return str(exc)


JAIL_MISSING = _available(IsolationLevel.JAIL_SECCOMP)
SECCOMP_MISSING = _available(IsolationLevel.SECCOMP)
needs_jail = pytest.mark.skipif(bool(JAIL_MISSING), reason=f"no jail here: {JAIL_MISSING}")
needs_seccomp = pytest.mark.skipif(bool(SECCOMP_MISSING),
                                   reason=f"no seccomp here: {SECCOMP_MISSING}")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def jail_pool():
    if JAIL_MISSING:
        pytest.skip(f"jail+seccomp unavailable: {JAIL_MISSING}")
    async with SandboxPool(PoolConfig(isolation=IsolationLevel.JAIL_SECCOMP, **FAST)) as pool:
        yield pool


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def seccomp_pool():
    if SECCOMP_MISSING:
        pytest.skip(f"seccomp unavailable: {SECCOMP_MISSING}")
    async with SandboxPool(PoolConfig(isolation=IsolationLevel.SECCOMP, **FAST)) as pool:
        yield pool


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def python_spawner_pool():
    """The fallback spawner (the zygote forks from Python: no C fork loop, no templates)."""
    if SECCOMP_MISSING:
        pytest.skip(f"seccomp unavailable: {SECCOMP_MISSING}")
    async with SandboxPool(PoolConfig(isolation=IsolationLevel.AUTO, spawner="python",
                                      **FAST)) as pool:
        yield pool


@pytest.fixture(params=["jail", "seccomp", "python_spawner"])
def any_pool(request):
    """Each seccomp-based level in turn (attacks that must fail with or without the jail),
    and the fallback spawner."""
    return request.getfixturevalue(f"{request.param}_pool")
