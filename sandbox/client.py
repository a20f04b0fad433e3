"""Sandbox clients: one interface, in-process or over HTTP, so the rollout engine does not care.

``SandboxClient`` is the protocol. ``LocalSandboxClient`` runs calls on a ``SandboxPool`` in this
process. ``HttpSandboxClient`` coalesces calls into batches (flushed at ``batch_size`` calls,
after ``batch_window_ms``, or at once when nothing is in flight), sends each batch to the node
with the fewest calls outstanding, and retries a batch on another node only when it provably
did not get an answer: a transport failure (connection refused/reset, node gone mid-request,
undecodable answer) or a 503 (overloaded / shutting down: nothing was run). Every call gets
exactly one ``ExecResult``; a call that cannot be served within ``call_timeout_s`` or after
``max_attempts`` becomes ``sandbox_failure`` with a ``detail``. Clients are opened with
``async with``. A node running several front ends (``sandbox serve --front-ends N``) is
addressed as N nodes, one per front end's private port, when those are reachable. Given a
``token``, the HTTP client sends it as a bearer token on every request;
a node that refuses it (401) fails ``__aenter__`` with ``AuthError`` (nothing ran).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import aiohttp
import msgspec
import structlog
from yarl import URL

from .auth import bearer
from .config import IsolationLevel, PoolConfig
from .errors import AuthError, IsolationUnavailable, Overloaded, PoolClosed, TransportError
from .pool import SandboxPool
from .records import ExecRequest, ExecResult
from .wire import FRAME, MSGPACK, STREAM, ExecBatch, codec_for

log = structlog.get_logger("sandbox.client")


@runtime_checkable
class SandboxClient(Protocol):
    """What the rollout engine talks to."""

    @property
    def isolation(self) -> str: ...

    async def execute(self, req: ExecRequest) -> ExecResult: ...

    async def execute_many(self, reqs: Sequence[ExecRequest]) -> list[ExecResult]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> SandboxClient: ...

    async def __aexit__(self, *exc: object) -> None: ...


def _check_isolation(have: str, want: str | None) -> None:
    if want is None or IsolationLevel(want) is IsolationLevel.AUTO:
        return
    if IsolationLevel(have).rank < IsolationLevel(want).rank:
        raise IsolationUnavailable(f"isolation {have!r} is weaker than the required {want!r}")


class LocalSandboxClient:
    """Calls run on a pool in this process.

    Given a ``SandboxPool`` it uses it as is (the caller owns it); given a ``PoolConfig`` (or
    nothing) it starts its own pool on ``__aenter__`` and closes it on ``aclose``.
    """

    def __init__(self, pool: SandboxPool | PoolConfig | None = None,
                 require_isolation: str | None = None) -> None:
        self._owns = not isinstance(pool, SandboxPool)
        self.pool = pool if isinstance(pool, SandboxPool) else SandboxPool(pool)
        self._require = require_isolation

    @property
    def isolation(self) -> str:
        return self.pool.isolation

    async def __aenter__(self) -> LocalSandboxClient:
        if self._owns:
            await self.pool.start()
        _check_isolation(self.pool.isolation, self._require)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns:
            await self.pool.aclose()

    async def execute(self, req: ExecRequest) -> ExecResult:
        try:
            return await self.pool.execute(req)
        except Overloaded as exc:
            return ExecResult.failure(f"overloaded: {exc}")

    async def execute_many(self, reqs: Sequence[ExecRequest]) -> list[ExecResult]:
        try:
            return await self.pool.execute_many(list(reqs))
        except Overloaded as exc:
            return [ExecResult.failure(f"overloaded: {exc}") for _ in reqs]


class _Call:
    __slots__ = ("deadline", "future", "req")

    def __init__(self, req: ExecRequest, future: asyncio.Future, deadline: float) -> None:
        self.req = req
        self.future = future
        self.deadline = deadline


class _Node:
    __slots__ = ("down_until", "failures", "isolation", "outstanding", "sent", "url")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.outstanding = 0
        self.down_until = 0.0
        self.failures = 0
        self.isolation = ""
        self.sent = 0


class _Retry(Exception):
    """This attempt got no answer; the batch may go to another node."""


class HttpSandboxClient:
    """Batching, load-spreading client for one or more ``sandbox serve`` nodes."""

    _loop: asyncio.AbstractEventLoop  # set by __aenter__
    _session: aiohttp.ClientSession  # given, or opened by __aenter__

    def __init__(self, urls: Sequence[str], *, batch_size: int = 64,
                 batch_window_ms: float = 2.0, call_timeout_s: float = 120.0,
                 connect_timeout_s: float = 3.0, max_attempts: int = 3,
                 backoff_s: float = 0.05, require_isolation: str | None = None,
                 token: str | None = None,
                 session: aiohttp.ClientSession | None = None) -> None:
        if not urls:
            raise ValueError("HttpSandboxClient needs at least one node URL")
        if batch_size < 1 or max_attempts < 1 or call_timeout_s <= 0:
            raise ValueError("batch_size and max_attempts must be >= 1, call_timeout_s > 0")
        self.nodes = [_Node(u) for u in urls]
        self.batch_size = batch_size
        self.batch_window_s = batch_window_ms / 1000.0
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self._require = require_isolation
        self._auth = bearer(token) if token else {}
        if session is not None:
            self._session = session
        self._owns_session = session is None
        self._codec = codec_for(MSGPACK)
        self._pending: list[_Call] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon = False
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._isolation = ""
        self.stats = {"batches": 0, "retries": 0, "transport_failures": 0, "overloaded": 0}

    # ------------------------------------------------------------------ lifecycle
    @property
    def isolation(self) -> str:
        """The weakest isolation level among the reachable nodes (known after ``__aenter__``)."""
        return self._isolation

    async def __aenter__(self) -> HttpSandboxClient:
        self._loop = asyncio.get_running_loop()
        if self._owns_session:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        try:
            await self._check_nodes()
        except BaseException:  # broad: close what we opened, then re-raise
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _health(self, node: _Node) -> dict | None:
        """The node's /health body (isolation noted on ``node``), or None if unreachable."""
        try:
            timeout = aiohttp.ClientTimeout(total=max(5.0, self.connect_timeout_s))
            async with self._session.get(node.url + "/health", timeout=timeout,
                                         headers=self._auth) as resp:
                if resp.status == 401:
                    raise AuthError(f"sandbox node {node.url} refused this client's token")
                info = await resp.json(content_type=None)
            if info.get("auth") == "token" and not self._auth:
                raise AuthError(f"sandbox node {node.url} requires a token; this client "
                                "has none")
            node.isolation = info.get("isolation", "")
            return info
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            node.down_until = time.monotonic() + 1.0
            log.warning("sandbox_node_unreachable", url=node.url, error=repr(exc))
            return None

    async def _check_nodes(self) -> None:
        async def one(node: _Node) -> list[_Node]:
            info = await self._health(node)
            ports = (info or {}).get("front_end_ports") or []
            if len(ports) < 2:
                return [node]
            # several front ends: address each on its private port (``sandbox.frontends``),
            # so that batches are spread by outstanding calls, not by which front end
            # happened to accept a connection; those not reachable (a port not forwarded)
            # leave the node as it was given
            subs = [_Node(str(URL(node.url).with_port(int(p)))) for p in ports]
            infos = await asyncio.gather(*(self._health(sub) for sub in subs))
            reachable = [sub for sub, i in zip(subs, infos, strict=True) if i is not None]
            return reachable if len(reachable) == len(subs) else [node]

        groups = await asyncio.gather(*(one(n) for n in self.nodes))
        self.nodes = [n for group in groups for n in group]
        levels = [n.isolation for n in self.nodes if n.isolation]
        if not levels:
            raise TransportError("no sandbox node answered /health: "
                                 + ", ".join(n.url for n in self.nodes))
        self._isolation = min(levels, key=lambda v: IsolationLevel(v).rank)
        _check_isolation(self._isolation, self._require)

    async def aclose(self) -> None:
        """Flush what is pending, wait for batches in flight, close the session we opened."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            self._flush()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._owns_session and hasattr(self, "_session"):
            await self._session.close()

    # ------------------------------------------------------------------ calls
    async def execute(self, req: ExecRequest) -> ExecResult:
        if self._closed:
            raise PoolClosed("client is closed")
        if not hasattr(self, "_loop"):
            raise PoolClosed("client not opened (use `async with HttpSandboxClient(...)`)")
        call = _Call(req, self._loop.create_future(), time.monotonic() + self.call_timeout_s)
        self._enqueue(call)
        try:
            async with asyncio.timeout(self.call_timeout_s):
                return await asyncio.shield(call.future)
        except TimeoutError:
            if not call.future.done():
                call.future.set_result(ExecResult.failure(
                    f"no answer within the client's {self.call_timeout_s:g}s call timeout"))
            return call.future.result()

    async def execute_many(self, reqs: Sequence[ExecRequest]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.execute(r) for r in reqs)))

    def _enqueue(self, call: _Call) -> None:
        self._pending.append(call)
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif not self._tasks and not self._flush_soon:
            # nothing in flight: send at the end of this loop iteration (calls made in the
            # same iteration still share the batch) instead of waiting for the window
            self._flush_soon = True
            self._loop.call_soon(self._flush)
        elif self._timer is None and not self._flush_soon:
            self._timer = self._loop.call_later(self.batch_window_s, self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch = self._pending[:self.batch_size]
            del self._pending[:self.batch_size]
            task = self._loop.create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ transport
    def _pick(self, tried: set[_Node]) -> _Node:
        now = time.monotonic()
        fresh = [n for n in self.nodes if n not in tried] or self.nodes
        up = [n for n in fresh if n.down_until <= now]
        if up:
            return min(up, key=lambda n: n.outstanding)
        return min(fresh, key=lambda n: n.down_until)

    def _mark_down(self, node: _Node) -> None:
        node.failures += 1
        node.down_until = time.monotonic() + min(0.5 * 2 ** (node.failures - 1), 10.0)

    async def _send(self, batch: list[_Call]) -> None:
        tried: set[_Node] = set()
        last_error = ""
        for attempt in range(self.max_attempts):
            live = [c for c in batch if not c.future.done()]
            if not live:
                return
            remaining = max(c.deadline for c in live) - time.monotonic()
            if remaining <= 0:
                break
            node = self._pick(tried)
            tried.add(node)
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 1.0))
            try:
                await self._post(node, live, remaining)
            except _Retry as exc:
                last_error = f"{node.url}: {exc}"
                continue
            node.failures = 0
            return
        for call in batch:
            if not call.future.done():
                call.future.set_result(ExecResult.failure(
                    f"no sandbox node answered after {len(tried)} attempt(s): {last_error}"))

    async def _post(self, node: _Node, calls: list[_Call], timeout_s: float) -> None:
        """Send ``calls`` to ``node`` and resolve each call's future as its answer streams in.
        Raises _Retry if some calls got no answer and may be sent elsewhere."""
        body = self._codec.encode(ExecBatch([c.req for c in calls]))
        node.outstanding += len(calls)
        node.sent += 1
        self.stats["batches"] += 1
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        headers = {"Content-Type": MSGPACK, "Accept": STREAM, **self._auth}
        try:
            async with self._session.post(node.url + "/v1/execute", data=body, timeout=timeout,
                                          headers=headers) as resp:
                if resp.status == 200 and resp.content_type == STREAM:
                    await self._read_stream(resp, calls)
                    return
                data = await resp.read()
                status = resp.status
                ctype = resp.headers.get("Content-Type")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.IncompleteReadError) as exc:
            self.stats["transport_failures"] += 1
            self._mark_down(node)
            raise _Retry(f"transport failure: {exc!r}") from None
        except TimeoutError:
            # the batch's deadline passed on this node; there is no time left to retry
            raise _Retry(f"no answer within {timeout_s:.1f}s") from None
        finally:
            node.outstanding -= len(calls)
        codec = codec_for(ctype)
        if status == 200:  # a node answering the whole batch at once (no stream support)
            try:
                results = codec.result.decode(data).results
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._mark_down(node)
                raise _Retry(f"undecodable answer: {exc}") from None
            if len(results) != len(calls):
                self._mark_down(node)
                raise _Retry(f"answer has {len(results)} results for {len(calls)} calls")
            for call, result in zip(calls, results, strict=True):
                if not call.future.done():
                    call.future.set_result(result)
            return
        reason = data[:300].decode("utf-8", "replace")
        try:
            err = codec.error.decode(data)
            reason = f"{err.error}: {err.reason}"
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        if status == 503:  # overloaded or draining: nothing ran, another node may take it
            self.stats["overloaded"] += 1
            node.down_until = time.monotonic() + 0.2
            raise _Retry(f"HTTP 503 {reason}")
        for call in calls:
            if not call.future.done():
                call.future.set_result(ExecResult.failure(
                    f"node {node.url} answered HTTP {status}: {reason}"))

    async def _read_stream(self, resp: aiohttp.ClientResponse, calls: list[_Call]) -> None:
        decode = self._codec.frame.decode
        answered = 0
        while answered < len(calls):
            (size,) = FRAME.unpack(await resp.content.readexactly(4))
            try:
                index, result = decode(await resp.content.readexactly(size))
                call = calls[index]
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
                raise aiohttp.ClientPayloadError(f"bad frame from node: {exc}") from None
            if not call.future.done():
                call.future.set_result(result)
            answered += 1
