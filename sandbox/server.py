"""``sandbox serve``: the executor pool behind an aiohttp HTTP endpoint, one per sandbox node.

Routes:
- ``POST /v1/execute``: a batch of calls (see ``sandbox.wire``), answered in request order.
- ``GET /health``: isolation level in force, workers, queue, in-flight calls, the default and
  largest call time limits (what a client needs to bound a batch's run time) (JSON). HTTP 200
  while serving, 503 while shutting down or when no worker can be started.
- ``GET /metrics``: Prometheus text: calls by status, latency histogram, queue depth, ...

Authentication (``sandbox.auth`` states the policy): with a token configured, ``/v1/execute``
and ``/metrics`` need ``Authorization: Bearer <token>`` (else 401, nothing decoded or run,
the refusal counted); ``/health`` without credentials answers only status, isolation and
whether a token is required.

Overload is answered, not buffered: a batch that does not fit in the pool's bounded queue gets
HTTP 503 with ``{"error": "overloaded", "reason": ...}`` and nothing of it runs. Shutdown
(SIGTERM/SIGINT) stops accepting batches (503 ``shutting_down``), lets the batches in flight
finish (up to ``--shutdown-grace``), then closes the listener and the pool.

Binds 127.0.0.1 by default: the endpoint runs arbitrary code by design. A node bound to any
other address refuses to start without a token (from a file or an environment variable).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import socket
import sys
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from . import auth
from .errors import Overloaded, PoolClosed
from .frontends import SINGLE, FrontEnd
from .metrics import render
from .pool import SandboxPool
from .records import ExecResult
from .wire import (
    FRAME,
    HEARTBEAT,
    JSON,
    MSGPACK,
    STREAM,
    ErrorBody,
    ExecBatchResult,
    codec_for,
    heartbeat_interval,
)

_json = msgspec.json.Encoder()
POOL_KEY: web.AppKey[SandboxPool] = web.AppKey("sandbox_pool", SandboxPool)


class ServerState:
    """What the HTTP layer counts and whether it is draining."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.draining = False
        self.inflight_batches = 0
        self.batches = 0
        self.rejected: dict[str, int] = {}
        self.started = time.monotonic()
        self.idle = asyncio.Event()
        self.idle.set()

    def reject(self, kind: str) -> None:
        self.rejected[kind] = self.rejected.get(kind, 0) + 1


STATE_KEY: web.AppKey[ServerState] = web.AppKey("sandbox_state", ServerState)


def _error(status: int, kind: str, reason: str, content_type: str | None) -> web.Response:
    codec = codec_for(content_type)
    headers = ({"Retry-After": "1"} if status == 503
               else {"WWW-Authenticate": 'Bearer realm="sandbox"'} if status == 401 else None)
    return web.Response(status=status, body=codec.encode(ErrorBody(kind, reason)),
                        content_type=codec.content_type, headers=headers)


# Over 80 lines on purpose: the handlers are closures over one pool, codec and limits, so the
# whole HTTP surface of a node (routes, auth, batching, streaming) reads as one page.
def build_app(pool: SandboxPool, *, max_batch: int = 1024, max_body_bytes: int = 256 << 20,
              token: str | None = None, front_end: FrontEnd = SINGLE) -> web.Application:
    """The aiohttp application serving ``pool`` (started and closed by the caller). With a
    ``token``, requests are authenticated as ``sandbox.auth`` states; without, all pass."""
    state = ServerState(max_batch)
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[auth.middleware(token, state.reject, _error)])
    app[POOL_KEY] = pool
    app[STATE_KEY] = state

    async def execute(request: web.Request) -> web.StreamResponse:
        ctype = request.headers.get("Content-Type")
        if state.draining:
            state.reject("shutting_down")
            return _error(503, "shutting_down", "this node is shutting down", ctype)
        codec = codec_for(ctype)
        try:
            batch = codec.batch.decode(await request.read())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            state.reject("bad_request")
            return _error(400, "bad_request", f"malformed batch: {exc}", ctype)
        if len(batch.requests) > state.max_batch:
            state.reject("batch_too_large")
            return _error(413, "batch_too_large",
                          f"{len(batch.requests)} calls > max batch {state.max_batch}", ctype)
        state.inflight_batches += 1
        state.idle.clear()
        try:
            if STREAM in request.headers.get("Accept", ""):
                return await _stream_results(request, pool, batch.requests)
            results = await pool.execute_many(batch.requests)
        except Overloaded as exc:
            state.reject("overloaded")
            return _error(503, "overloaded", str(exc), ctype)
        except PoolClosed as exc:
            state.reject("shutting_down")
            return _error(503, "shutting_down", str(exc), ctype)
        finally:
            state.inflight_batches -= 1
            if state.inflight_batches == 0:
                state.idle.set()
        state.batches += 1
        return web.Response(body=codec.encode(ExecBatchResult(results)),
                            content_type=codec.content_type)

    async def health(request: web.Request) -> web.Response:
        info = pool.describe()
        info.update(status="draining" if state.draining else ("broken" if info["broken"]
                                                                 else "ok"),
                    inflight_batches=state.inflight_batches, auth="token" if token else "none",
                    front_end=front_end.index, front_ends=front_end.count,
                    front_end_ports=list(front_end.ports),
                    time_limit_s=pool.config.time_limit_s,
                    max_time_limit_s=pool.config.max_time_limit_s,
                    uptime_s=round(time.monotonic() - state.started, 1))
        code = 200 if info["status"] == "ok" else 503
        if request.get(auth.AUTH_RESULT_KEY) == "missing":  # an anonymous probe
            info = {k: info[k] for k in auth.PUBLIC_HEALTH_KEYS}
        return web.Response(status=code, body=_json.encode(info), content_type=JSON)

    async def metrics(request: web.Request) -> web.Response:
        gauges: dict[str, float] = {
            "sandbox_queue_depth": pool.queue_depth,
            "sandbox_inflight_calls": pool.inflight,
            "sandbox_capacity_calls": pool.capacity,
            "sandbox_workers_ready": sum(1 for w in pool.describe()["workers"] if w["ready"]),
            "sandbox_http_inflight_batches": state.inflight_batches,
            "sandbox_front_end_index": front_end.index,
            "sandbox_front_ends": front_end.count,
        }
        extra: dict[str, float] = {"sandbox_http_batches_total": state.batches}
        for kind, n in state.rejected.items():
            extra[f"sandbox_http_rejected_{kind}_total"] = n
        return web.Response(text=render(pool.metrics, gauges, extra),
                            content_type="text/plain", charset="utf-8")

    app.router.add_post("/v1/execute", execute)
    app.router.add_get("/health", health)
    app.router.add_get("/healthz", health)
    app.router.add_get("/metrics", metrics)
    return app


def _put_index(queue: asyncio.Queue, index: int, _fut: asyncio.Future) -> None:
    queue.put_nowait(index)


async def _stream_results(request: web.Request, pool: SandboxPool,
                          reqs: list) -> web.StreamResponse:
    """Answer each call as soon as it is done (frames in completion order), with an empty
    frame after each heartbeat interval without one when the client asked (``sandbox.wire``)."""
    futures = pool.submit_many(reqs)  # raises Overloaded before anything is sent
    done: asyncio.Queue[int] = asyncio.Queue()
    for i, fut in enumerate(futures):
        fut.add_done_callback(functools.partial(_put_index, done, i))
    beat = heartbeat_interval(request.headers.get(HEARTBEAT))
    headers = {"Content-Type": STREAM}
    if beat is not None:
        headers[HEARTBEAT] = f"{beat:g}"
    resp = web.StreamResponse(headers=headers)
    enc = codec_for(MSGPACK)
    try:
        await resp.prepare(request)
        remaining = len(futures)
        while remaining:
            try:
                async with asyncio.timeout(beat):  # None: no heartbeats asked for
                    ready = [await done.get()]
            except TimeoutError:
                await resp.write(FRAME.pack(0))  # an empty frame: still working on it
                continue
            while not done.empty():
                ready.append(done.get_nowait())
            buf = bytearray()
            for i in ready:
                fut = futures[i]
                result = (ExecResult.failure("cancelled") if fut.cancelled() else fut.result())
                data = enc.encode((i, result))
                buf += FRAME.pack(len(data)) + data
            remaining -= len(ready)
            await resp.write(buf)
        await resp.write_eof()
    except BaseException:  # client gone or handler cancelled: stop what is still running
        pool.cancel_all(futures)
        raise
    return resp


async def serve(pool_config, *, host: str, port: int, max_batch: int, shutdown_grace_s: float,
                token: str | None = None, socks: list[socket.socket] | None = None,
                front_end: FrontEnd = SINGLE,
                on_ready: Callable[[str], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code. Raises SandboxConfigError
    before starting anything if ``host`` is not loopback and there is no ``token``.

    ``socks``: already listening sockets to serve on (``host``/``port`` then only name them);
    ``front_end``: this process's place among the node's front ends (``sandbox.frontends``);
    ``on_ready(line)`` replaces printing the ready line."""
    auth.require_token_for(host, token)
    async with SandboxPool(pool_config) as pool:
        app = build_app(pool, max_batch=max_batch, token=token, front_end=front_end)
        state = app[STATE_KEY]
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            sites: list[web.BaseSite] = (
                [web.SockSite(runner, sock) for sock in socks] if socks else
                [web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)])
            for site in sites:
                await site.start()
            addr = runner.addresses[0]
            line = (f"sandbox serving on http://{addr[0]}:{addr[1]} "
                    f"isolation={pool.isolation} workers={pool_config.workers} "
                    f"auth={'token' if token else 'none'}")
            if on_ready is None:
                print(line, flush=True)
            else:
                on_ready(line)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            state.draining = True
            try:
                async with asyncio.timeout(shutdown_grace_s):
                    await state.idle.wait()
            except TimeoutError:
                print(f"sandbox: {state.inflight_batches} batches still running after "
                      f"{shutdown_grace_s:g}s; closing anyway", file=sys.stderr, flush=True)
        finally:
            await runner.cleanup()
    return 0

