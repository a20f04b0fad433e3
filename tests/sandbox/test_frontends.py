"""Several HTTP front ends on one port (``sandbox serve --front-ends N``): real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import aiohttp
import pytest

from sandbox import ExecRequest, HttpSandboxClient
from sandbox.errors import SandboxConfigError
from sandbox.frontends import split_workers

pytestmark = pytest.mark.timeout(90)


def test_workers_are_split_evenly_and_never_to_zero():
    assert split_workers(5, 2) == [3, 2]
    assert split_workers(16, 4) == [4, 4, 4, 4]
    with pytest.raises(SandboxConfigError, match="cannot be split"):
        split_workers(1, 2)


@contextlib.asynccontextmanager
async def node(*extra: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--port", "0", "--workers", "2",
        "--front-ends", "2", "--isolation", "seccomp", "--preload", "math", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("sandbox serving on ") and "front_ends=2" in line, (
            line, await proc.stderr.read())
        yield proc, line.split()[3]
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _front_end_pids(supervisor: int) -> list[int]:
    """The supervisor's children that are front ends (not zygotes or jails)."""
    out = []
    for pid in _children(supervisor):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"sandbox\x00serve" in f.read():
                out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_both_front_ends_serve_on_one_port_and_stop_on_sigterm():
    async with node() as (proc, url):
        seen: set[int] = set()
        for _ in range(60):  # a fresh connection each time: the kernel picks the front end
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
                info = await resp.json()
            assert info["front_ends"] == 2 and info["workers_configured"] == 1
            seen.add(info["front_end"])
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        async with HttpSandboxClient([url], batch_size=8) as client:
            assert len(client.nodes) == 2  # one per front end, on its private port
            results = await client.execute_many(
                [ExecRequest(f"print({i}*{i})") for i in range(200)])
        assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_a_dead_front_end_stops_the_whole_node():
    async with node() as (proc, _):
        victim, other = _front_end_pids(proc.pid)
        os.kill(victim, signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 30) == 1
        for _ in range(100):
            if not _alive(other):
                break
            await asyncio.sleep(0.1)
        assert not _alive(other)
        assert b"stopping the node" in await proc.stderr.read()


async def test_front_ends_die_with_a_killed_supervisor():
    async with node() as (proc, _):
        front_ends = _front_end_pids(proc.pid)
        assert len(front_ends) == 2
        proc.kill()
        await proc.wait()
        for _ in range(100):
            if not any(_alive(p) for p in front_ends):
                break
            await asyncio.sleep(0.1)
        assert not any(_alive(p) for p in front_ends)


async def test_the_client_spreads_calls_over_the_front_ends():
    """Batches go to each front end's private port by outstanding calls, not wherever one
    keep-alive connection happened to land: both front ends serve a share."""
    async with node() as (_, url), HttpSandboxClient([url], batch_size=4) as client:
        results = await client.execute_many(
            [ExecRequest("import time; time.sleep(0.2); print('ok')") for _ in range(32)])
        assert all(r.stdout == "ok\n" for r in results), results
        served = []
        async with aiohttp.ClientSession() as http:
            for n in client.nodes:
                async with http.get(n.url + "/metrics") as resp:
                    text = await resp.text()
                line = next(ln for ln in text.splitlines()
                            if ln.startswith('sandbox_calls_total{kind="exec",status="ok"}'))
                served.append(int(float(line.split()[-1])))
        assert sum(served) == 32 and min(served) >= 8, served
