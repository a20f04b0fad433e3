"""The HTTP node and the batching client: round trips, overload answer, failover, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from sandbox import (
    ExecRequest,
    HttpSandboxClient,
    IsolationUnavailable,
    LocalSandboxClient,
    PoolConfig,
    SandboxClient,
    SandboxPool,
    TransportError,
)
from sandbox.server import build_app
from sandbox.wire import JSON

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(90)]


@contextlib.asynccontextmanager
async def serving(pool, **kw):
    """``pool`` behind an in-process aiohttp server on a free loopback port."""
    runner = web.AppRunner(build_app(pool, **kw), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", runner.app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def node_process(*extra: str):
    """A real ``python -m sandbox serve`` process (light preload: starts in well under 1 s)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--port", "0", "--workers", "1",
        "--isolation", "seccomp", "--preload", "math", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("sandbox serving on "), line
        yield proc, line.split()[3]
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_batch_round_trip_health_and_metrics(jail_pool):
    async with serving(jail_pool) as (url, _app), HttpSandboxClient([url]) as client:
        assert isinstance(client, SandboxClient) and client.isolation == "jail+seccomp"
        r = await client.execute(ExecRequest("import sys; print(sys.stdin.read()[::-1])", "abc"))
        assert (r.status, r.stdout) == ("ok", "cba\n")
        results = await asyncio.gather(*(client.execute(ExecRequest(f"{i} ** 2"))
                                         for i in range(150)))
        assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(150)]
        assert client.stats["batches"] < 150 / 2  # coalesced, not one request per call
        async with aiohttp.ClientSession() as s:
            body = b'{"requests": [{"code": "print(40 + 2)"}, {"code": "1/0"}]}'
            async with s.post(url + "/v1/execute", data=body,
                              headers={"Content-Type": JSON}) as resp:
                assert resp.status == 200 and resp.content_type == JSON
                out = await resp.json()
            assert [x["status"] for x in out["results"]] == ["ok", "error"]
            assert out["results"][0]["stdout"] == "42\n"
            async with s.post(url + "/v1/execute", data=b"{not json",
                              headers={"Content-Type": JSON}) as resp:
                assert resp.status == 400 and (await resp.json())["error"] == "bad_request"
            async with s.get(url + "/health") as resp:
                health = await resp.json()
            assert health["status"] == "ok" and health["isolation"] == "jail+seccomp"
            assert health["workers_ready"] == 2 and "queue" in health
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'sandbox_calls_total{kind="exec",status="ok"}' in text
            assert "sandbox_queue_depth" in text and "sandbox_call_latency_seconds_bucket" in text


async def test_a_slow_call_does_not_hold_back_the_rest_of_its_batch(jail_pool):
    async with serving(jail_pool) as (url, _app), HttpSandboxClient([url]) as client:
        slow = asyncio.ensure_future(client.execute(
            ExecRequest("import time; time.sleep(1.5); print('slow')")))
        fast = [asyncio.ensure_future(client.execute(ExecRequest(f"print({i})")))
                for i in range(10)]
        t0 = time.monotonic()
        results = await asyncio.gather(*fast)
        assert time.monotonic() - t0 < 1.2 and not slow.done()
        assert client.stats["batches"] == 1  # same batch, answered as each call finished
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
        assert (await slow).stdout == "slow\n"


async def test_overload_is_answered_with_503_and_a_reason():
    cfg = PoolConfig(workers=1, isolation="seccomp", max_inflight_per_worker=1, queue_limit=1,
                     preload=("time",))
    async with SandboxPool(cfg) as pool, serving(pool) as (url, _app):
        busy = [asyncio.ensure_future(pool.execute(ExecRequest("import time; time.sleep(0.5)")))
                for _ in range(2)]
        await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            body = b'{"requests": [{"code": "print(1)"}, {"code": "print(2)"}]}'
            async with s.post(url + "/v1/execute", data=body,
                              headers={"Content-Type": JSON}) as resp:
                assert resp.status == 503 and resp.headers.get("Retry-After")
                err = await resp.json()
        assert err["error"] == "overloaded" and "queue full" in err["reason"]
        assert [r.status for r in await asyncio.gather(*busy)] == ["ok", "ok"]
        async with HttpSandboxClient([url], max_attempts=1) as client:
            # a lone overloaded node: the client answers sandbox_failure, it does not hang
            busy = [asyncio.ensure_future(pool.execute(ExecRequest("import time; time.sleep(0.5)")))
                    for _ in range(2)]
            await asyncio.sleep(0.05)
            r = await client.execute(ExecRequest("print(3)"))
            assert r.status == "sandbox_failure" and "overloaded" in r.detail
            await asyncio.gather(*busy)


async def test_a_node_killed_mid_batch_is_retried_on_another_node():
    async with node_process() as (a, url_a), node_process() as (_b, url_b):
        async with HttpSandboxClient([url_a, url_b], batch_size=64) as client:
            reqs = [ExecRequest(f"import time; time.sleep(0.6); print({i})") for i in range(12)]
            pending = asyncio.ensure_future(client.execute_many(reqs))
            await asyncio.sleep(0.3)  # the batch is running on node A (first, both idle)
            a.send_signal(signal.SIGKILL)
            results = await asyncio.wait_for(pending, 20)
        assert len(results) == 12
        assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(12)]
        assert client.stats["transport_failures"] >= 1 and client.stats["retries"] >= 1


async def test_graceful_shutdown_finishes_running_batches():
    async with node_process("--shutdown-grace", "10") as (proc, url):
        async with HttpSandboxClient([url], max_attempts=1) as client:
            reqs = [ExecRequest(f"import time; time.sleep(0.8); print({i})") for i in range(4)]
            pending = asyncio.ensure_future(client.execute_many(reqs))
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(pending, 10)
            assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(4)]
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            r = await client.execute(ExecRequest("print('after')"))
            assert r.status == "sandbox_failure"  # nobody is listening any more


async def test_client_deadline_and_unreachable_nodes(jail_pool):
    async with serving(jail_pool) as (url, _app):
        async with HttpSandboxClient(["http://127.0.0.1:9", url], call_timeout_s=0.5) as client:
            t0 = time.monotonic()
            r = await client.execute(ExecRequest("import time; time.sleep(3)", "", 4))
            assert r.status == "sandbox_failure" and time.monotonic() - t0 < 1.5
            r = await client.execute(ExecRequest("print('still fine')"))
            assert r.stdout == "still fine\n"
        with pytest.raises(IsolationUnavailable):
            async with HttpSandboxClient([url], require_isolation="jail+seccomp") as c:
                assert c.isolation == "jail+seccomp"
                raise IsolationUnavailable("reached: requirement was satisfied")
    with pytest.raises(TransportError):
        async with HttpSandboxClient(["http://127.0.0.1:9"]):
            pass


async def test_local_client_has_the_same_interface(jail_pool):
    async with LocalSandboxClient(jail_pool) as client:
        assert isinstance(client, SandboxClient) and client.isolation == "jail+seccomp"
        rs = await client.execute_many([ExecRequest("print(1)"), ExecRequest("1/0")])
        assert [r.status for r in rs] == ["ok", "error"]
    r = await jail_pool.execute(ExecRequest("print('pool untouched')"))
    assert r.status == "ok"  # the client did not close a pool it does not own
    with pytest.raises(IsolationUnavailable):
        async with LocalSandboxClient(PoolConfig(isolation="none", workers=1, preload=()),
                                      require_isolation="seccomp"):
            pass
