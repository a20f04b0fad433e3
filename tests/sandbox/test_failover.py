"""Failover of the HTTP client when a node goes silent: a link cut without a reset, a node
that sends no heartbeats, every node gone; and the pure policy of ``sandbox.failover``.

The silent node is a real node behind ``Link``, a loopback TCP hop that can be cut like a
network link: cut, it still accepts connections but drops every byte both ways and closes
nothing (no FIN, no RST), so the client sees exactly what a blackholed link shows it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import web

from sandbox import ExecRequest, HttpSandboxClient
from sandbox.failover import Node, attempt_budget, pick, probe_delays, work_bound
from sandbox.server import build_app
from sandbox.wire import STREAM

pytestmark = pytest.mark.timeout(60)
on_session_loop = pytest.mark.asyncio(loop_scope="session")

FAST = dict(stall_timeout_s=1.0, connect_timeout_s=1.0, call_timeout_s=30.0,
            probe_interval_s=0.2, probe_max_interval_s=0.5)


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class Link:
    """A TCP hop to ``upstream`` (host:port) that ``cut()`` turns into a black hole for every
    connection it has or gets; after ``heal()`` new connections go through again (the ones
    open during the cut stay dead, as the client has given up on them)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit("/", 1)[-1].split(":")
        self.upstream = (host, int(port))
        self.is_cut = False
        self._tasks: set[asyncio.Task] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Link:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            w.close()

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        self.is_cut = False

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        dead = [self.is_cut]
        up_reader = up_writer = None
        if not dead[0]:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.append(up_writer)
        self._spawn(self._pump(reader, up_writer, dead))
        if up_reader is not None:
            self._spawn(self._pump(up_reader, writer, dead))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None,
                    dead: list[bool]) -> None:
        while data := await src.read(1 << 16):
            dead[0] = dead[0] or self.is_cut
            if dead[0] or dst is None:
                continue  # dropped on the floor
            dst.write(data)
            await dst.drain()
        if not dead[0] and dst is not None:
            dst.close()


def sleepers(n: int, seconds: float) -> list[ExecRequest]:
    return [ExecRequest(f"import time; time.sleep({seconds}); print({i})", "", 2.0)
            for i in range(n)]


async def wait_until(predicate, within_s: float) -> None:
    for _ in range(int(within_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached within {within_s}s")


@on_session_loop
async def test_a_cut_link_moves_calls_to_the_other_node_and_heals(jail_pool):
    async with serving(build_app(jail_pool)) as direct, Link(direct) as link, \
            serving(build_app(jail_pool)) as good, \
            HttpSandboxClient([link.url, good], **FAST) as client:
        cut, other = client.nodes
        pending = asyncio.ensure_future(client.execute_many(sleepers(6, 0.3)))
        await asyncio.sleep(0.1)  # the batch is on the first node (both idle: the first)
        assert cut.sent == 1 and other.sent == 0
        link.cut()
        t0 = time.monotonic()
        results = await pending
        failover_s = time.monotonic() - t0
        # every call answered by the other node, after a stall of 1 s, not the 30 s deadline
        assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(6)]
        assert failover_s < 4.0, failover_s
        assert cut.down and "silent for 1s" in cut.down_reason
        assert client.stats["stalls"] == 1 and client.stats["nodes_marked_down"] == 1

        # while it is down, nothing goes to it
        for _ in range(3):
            assert (await client.execute(ExecRequest("print('b')"))).stdout == "b\n"
        assert cut.sent == 1

        link.heal()  # /health answers again: back in rotation
        await wait_until(lambda: not cut.down, 5.0)
        assert client.stats["nodes_marked_up"] == 1
        r = await client.execute(ExecRequest("print('a')"))
        assert r.stdout == "a\n" and cut.sent == 2  # both idle again: the first node


@on_session_loop
async def test_when_every_node_goes_silent_calls_fail_fast_naming_each(jail_pool):
    async with serving(build_app(jail_pool)) as direct, Link(direct) as a, Link(direct) as b, \
            HttpSandboxClient([a.url, b.url], **FAST) as client:
        a.cut()
        b.cut()
        t0 = time.monotonic()
        r = await client.execute(ExecRequest("print(1)"))
        elapsed = time.monotonic() - t0
        assert r.status == "sandbox_failure"
        assert a.url in r.detail and b.url in r.detail and "no node is up" in r.detail
        assert elapsed < 6.0, elapsed  # two stalls of 1 s, not the 30 s call deadline
        t0 = time.monotonic()
        r = await client.execute(ExecRequest("print(2)"))  # both down: no wait at all
        assert r.status == "sandbox_failure" and time.monotonic() - t0 < 0.5


@on_session_loop
async def test_a_node_without_heartbeats_is_given_the_work_bound(jail_pool):
    """An older node (no heartbeats) that accepted a batch and then hangs is left once the
    batch's longest time limit plus the margin has passed."""
    async def health(_req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "isolation": "jail+seccomp", "auth": "none"})

    async def hang(req: web.Request) -> web.StreamResponse:
        await req.read()
        resp = web.StreamResponse(headers={"Content-Type": STREAM})
        await resp.prepare(req)
        await asyncio.sleep(3600)
        return resp

    old = web.Application()
    old.router.add_get("/health", health)
    old.router.add_post("/v1/execute", hang)
    async with serving(old) as silent, serving(build_app(jail_pool)) as good, \
            HttpSandboxClient([silent, good], attempt_margin_s=0.5, **FAST) as client:
        t0 = time.monotonic()
        r = await client.execute(ExecRequest("print('x')", "", 0.5))
        assert r.stdout == "x\n" and time.monotonic() - t0 < 3.0
        hung = client.nodes[0]
        assert hung.down and "work bound" in hung.down_reason


# ----------------------------------------------------------------------- the pure policy
def test_an_attempt_leaves_a_work_bound_for_the_failover():
    # 10 s left, a batch that needs at most 4 s: this attempt may take 6 s, a failover 4 s
    assert attempt_budget(10.0, 4.0, can_fail_over=True) == 6.0
    # little time left: a live node still gets the whole work bound (or what is left)
    assert attempt_budget(6.0, 4.0, can_fail_over=True) == 4.0
    assert attempt_budget(3.0, 4.0, can_fail_over=True) == 3.0
    # nowhere else to go: all of it
    assert attempt_budget(10.0, 4.0, can_fail_over=False) == 10.0


def test_down_nodes_are_never_picked_and_limits_bound_the_work():
    a, b, c = Node("http://a"), Node("http://b/"), Node("http://c")
    assert b.url == "http://b"
    a.outstanding, b.outstanding, c.outstanding = 0, 5, 9
    assert pick([a, b, c], [], now=0.0) is a
    assert a.mark_down("silent", now=1.0) and not a.mark_down("again", now=2.0)
    assert a.down_reason == "silent"
    assert pick([a, b, c], [], now=3.0) is b
    assert pick([a, b, c], [b], now=3.0) is c  # not tried yet
    b.busy_until = 10.0  # answered 503
    assert pick([a, b, c], [c], now=3.0) is b  # not tried yet beats not busy
    assert pick([a, b, c], [b, c], now=3.0) is c  # both tried: the one not busy
    assert a.mark_up(now=4.0) == 3.0 and pick([a, b, c], [], now=4.0) is a
    for n in (a, b, c):
        n.mark_down("gone", now=5.0)
    assert pick([a, b, c], [], now=5.0) is None
    a.time_limit_s, a.max_time_limit_s = 4.0, 10.0
    assert work_bound(a, [None, 2.0], margin_s=1.0) == 5.0  # the node's default, 4 s
    assert work_bound(a, [60.0], margin_s=1.0) == 11.0  # capped as the node caps it
    delays = probe_delays(0.25, 1.0)
    assert [next(delays) for _ in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]
