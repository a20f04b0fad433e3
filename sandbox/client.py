"""Sandbox clients: one interface, in-process or over HTTP, so the rollout engine does not care.

``SandboxClient`` is the protocol. ``LocalSandboxClient`` runs calls on a ``SandboxPool`` in this
process. ``HttpSandboxClient`` coalesces calls into batches (flushed at ``batch_size`` calls,
after ``batch_window_ms``, or at once when nothing is in flight) and sends each batch to the
node with the fewest calls outstanding. Every call gets exactly one ``ExecResult`` within
``call_timeout_s``; one that no node could serve becomes ``sandbox_failure`` with a ``detail``
naming each node tried and why it failed. Clients are opened with ``async with``. A node
running several front ends (``sandbox serve --front-ends N``) is addressed as N nodes, one per
front end's private port, when those are reachable. Given a ``token``, the HTTP client sends
it as a bearer token on every request; a node that refuses it (401) fails ``__aenter__`` with
``AuthError`` (nothing ran).

Failover (the policy is ``sandbox.failover``'s). A batch goes to another node, up to
``max_attempts`` attempts in all, when its node:

- is not reachable or breaks the connection (refused, reset, connect timeout, an undecodable
  answer); the node is marked down;
- answers 503 (overloaded or draining: nothing ran); the node is skipped for a moment;
- goes silent: the client asks every node for heartbeats (an empty stream frame after each
  quarter of ``stall_timeout_s`` without a result, ``sandbox.wire``), so a node or link that
  stops answering (a cut link drops packets without a reset, and the connection just hangs)
  is caught after ``stall_timeout_s`` of silence, not at the call's deadline. The node is
  marked down. A node that sends no heartbeats (an older server) is given the batch's work
  bound instead: its longest call's time limit plus ``attempt_margin_s``;
- takes longer than this attempt's share of the deadline while another node could still run
  the calls (``failover.attempt_budget``); the node is alive, so it stays up.

Only the calls whose result has not arrived are sent again (each streamed result is kept as
it comes). One that the silent node did run may thus run twice; that is safe because a
sandboxed call is side-effect free outside its jail (a fresh process and working directory,
no network, nothing written that outlives the call: ``sandbox.isolation``), and its first
result never reaches the caller. A down node is never picked; a background task per down node
probes its ``/health`` (timeout ``stall_timeout_s``, waits doubling from
``probe_interval_s`` to ``probe_max_interval_s``) and puts it back once it answers 200. Both
transitions are logged (``sandbox_node_down`` / ``sandbox_node_up``, with the URL and the
reason) and counted in ``stats``. When every node is down a call fails at once (nothing could
run it) instead of waiting out its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import aiohttp
import msgspec
import structlog
from yarl import URL

from .auth import bearer
from .config import IsolationLevel, PoolConfig
from .errors import AuthError, IsolationUnavailable, Overloaded, PoolClosed, TransportError
from .failover import Node, attempt_budget, pick, probe_delays, work_bound
from .pool import SandboxPool
from .records import ExecRequest, ExecResult
from .wire import FRAME, HEARTBEAT, MSGPACK, STREAM, Codec, ExecBatch, codec_for

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


class _Retry(Exception):
    """This attempt got no answer; the batch may go to another node."""


class HttpSandboxClient:
    """Batching, load-spreading, failing-over client for one or more ``sandbox serve`` nodes.

    ``call_timeout_s``: the deadline of one call, every attempt and transport included.
    ``stall_timeout_s``: silence (no result, no heartbeat) after which a node is taken for
    dead. ``attempt_margin_s``: added to a batch's longest time limit to bound how long a
    node may legitimately take (the work bound). ``probe_interval_s`` /
    ``probe_max_interval_s``: the first and the longest wait between health probes of a down
    node."""

    _loop: asyncio.AbstractEventLoop  # set by __aenter__
    _session: aiohttp.ClientSession  # given, or opened by __aenter__

    def __init__(self, urls: Sequence[str], *, batch_size: int = 64,
                 batch_window_ms: float = 2.0, call_timeout_s: float = 120.0,
                 connect_timeout_s: float = 3.0, max_attempts: int = 3,
                 backoff_s: float = 0.05, stall_timeout_s: float = 3.0,
                 attempt_margin_s: float = 3.0, probe_interval_s: float = 0.25,
                 probe_max_interval_s: float = 10.0, require_isolation: str | None = None,
                 token: str | None = None,
                 session: aiohttp.ClientSession | None = None) -> None:
        if not urls:
            raise ValueError("HttpSandboxClient needs at least one node URL")
        if batch_size < 1 or max_attempts < 1 or call_timeout_s <= 0:
            raise ValueError("batch_size and max_attempts must be >= 1, call_timeout_s > 0")
        if min(stall_timeout_s, probe_interval_s, probe_max_interval_s) <= 0:
            raise ValueError("stall_timeout_s and the probe intervals must be > 0")
        self.nodes = [Node(u) for u in urls]
        self.batch_size = batch_size
        self.batch_window_s = batch_window_ms / 1000.0
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.stall_timeout_s = stall_timeout_s
        self.attempt_margin_s = attempt_margin_s
        self.probe_interval_s = probe_interval_s
        self.probe_max_interval_s = probe_max_interval_s
        self._require = require_isolation
        self._auth = bearer(token) if token else {}
        if session is not None:
            self._session = session
        self._owns_session = session is None
        self._codec = codec_for(MSGPACK)
        self._pending: list[_Call] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flush_soon = False
        self._tasks: set[asyncio.Task] = set()  # batches in flight
        self._probes: dict[Node, asyncio.Task] = {}  # one per down node
        self._closed = False
        self._isolation = ""
        self.stats = {"batches": 0, "retries": 0, "transport_failures": 0, "overloaded": 0,
                      "stalls": 0, "attempt_timeouts": 0, "nodes_marked_down": 0,
                      "nodes_marked_up": 0}

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

    async def _health(self, node: Node, timeout_s: float) -> dict:
        """The node's /health body (isolation and time limits noted on ``node``). Raises
        AuthError if it refuses our token, TransportError if it is not serving."""
        try:
            async with self._session.get(node.url + "/health", headers=self._auth,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status == 401:
                    raise AuthError(f"sandbox node {node.url} refused this client's token")
                info = await resp.json(content_type=None)
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise TransportError(f"/health: {exc!r}") from None
        if not isinstance(info, dict):
            raise TransportError(f"/health answered {info!r}")
        if info.get("auth") == "token" and not self._auth:
            raise AuthError(f"sandbox node {node.url} requires a token; this client has none")
        node.isolation = info.get("isolation", "")
        node.time_limit_s = float(info.get("time_limit_s", node.time_limit_s))
        node.max_time_limit_s = float(info.get("max_time_limit_s", node.max_time_limit_s))
        if status != 200:
            raise TransportError(f"/health answered HTTP {status} ({info.get('status')})")
        return info

    async def _check_nodes(self) -> None:
        unreachable: dict[Node, str] = {}

        async def health(node: Node) -> dict | None:
            try:
                return await self._health(node, max(5.0, self.connect_timeout_s))
            except AuthError:
                raise
            except TransportError as exc:
                log.warning("sandbox_node_unreachable", url=node.url, error=str(exc))
                unreachable[node] = str(exc)
                return None

        async def one(node: Node) -> list[Node]:
            info = await health(node)
            ports = (info or {}).get("front_end_ports") or []
            if len(ports) < 2:
                return [node]
            # several front ends: address each on its private port (``sandbox.frontends``),
            # so that batches are spread by outstanding calls, not by which front end
            # happened to accept a connection; those not reachable (a port not forwarded)
            # leave the node as it was given
            subs = [Node(str(URL(node.url).with_port(int(p)))) for p in ports]
            infos = await asyncio.gather(*(health(sub) for sub in subs))
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
        for node in self.nodes:
            if node in unreachable:
                self._mark_down(node, f"unreachable at start ({unreachable[node]})")

    async def aclose(self) -> None:
        """Flush what is pending, wait for batches in flight, stop the probes, close the
        session we opened."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            self._flush()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
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

    # ------------------------------------------------------------------ node health
    def _mark_down(self, node: Node, reason: str) -> None:
        if not node.mark_down(reason, time.monotonic()):
            return
        self.stats["nodes_marked_down"] += 1
        log.warning("sandbox_node_down", url=node.url, reason=reason)
        if not self._closed:
            self._probes[node] = self._loop.create_task(self._probe(node))

    async def _probe(self, node: Node) -> None:
        """Probe a down node's /health until it answers 200, then put it back in rotation."""
        try:
            for delay in probe_delays(self.probe_interval_s, self.probe_max_interval_s):
                await asyncio.sleep(delay)
                try:
                    await self._health(node, self.stall_timeout_s)
                except TransportError as exc:  # AuthError included: not servable by us
                    log.debug("sandbox_node_probe_failed", url=node.url, error=str(exc))
                    continue
                was = node.mark_up(time.monotonic())
                self.stats["nodes_marked_up"] += 1
                log.info("sandbox_node_up", url=node.url,
                         reason=f"/health answered after {was:.1f}s down")
                return
        finally:
            self._probes.pop(node, None)

    # ------------------------------------------------------------------ transport
    async def _send(self, batch: list[_Call]) -> None:
        tried: list[Node] = []
        errors: list[str] = []
        for attempt in range(self.max_attempts):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 1.0))
            live = [c for c in batch if not c.future.done()]
            if not live:
                return
            now = time.monotonic()
            remaining = max(c.deadline for c in live) - now
            if remaining <= 0:
                break
            node = pick(self.nodes, tried, now)
            if node is None:
                errors.append("no node is up (" + "; ".join(
                    f"{n.url} down for {now - n.down_since:.1f}s: {n.down_reason}"
                    for n in self.nodes if n not in tried) + ")")
                break
            tried.append(node)
            bound = work_bound(node, (c.req.time_limit_s for c in live), self.attempt_margin_s)
            can_fail_over = attempt + 1 < self.max_attempts and any(
                n is not node and not n.down for n in self.nodes)
            try:
                await self._post(node, live, attempt_budget(remaining, bound, can_fail_over),
                                 bound)
            except _Retry as exc:
                errors.append(f"{node.url}: {exc}")
                continue
            return
        detail = (f"no sandbox node answered after {len(tried)} attempt(s): "
                  + "; ".join(errors or ["the deadline passed"]))
        for call in batch:
            if not call.future.done():
                call.future.set_result(ExecResult.failure(detail))

    async def _post(self, node: Node, calls: list[_Call], budget_s: float,
                    bound_s: float) -> None:
        """Send ``calls`` to ``node`` and resolve each call's future as its answer streams in.
        Raises _Retry if some calls got no answer and may be sent elsewhere. One clock
        (`_AttemptClock`) covers the attempt. Silence and the work bound mark the node down;
        the budget does not (the node may be alive and slow)."""
        body = self._codec.encode(ExecBatch([c.req for c in calls]))
        node.outstanding += len(calls)
        node.sent += 1
        self.stats["batches"] += 1
        clock = _AttemptClock(self._loop, self.stall_timeout_s, self.connect_timeout_s,
                              budget_s, bound_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        headers = {"Content-Type": MSGPACK, "Accept": STREAM,
                   HEARTBEAT: f"{clock.silence / 4:g}", **self._auth}
        try:
            async with asyncio.timeout(None) as timer:
                clock.arm(timer, "headers")
                async with self._session.post(node.url + "/v1/execute", data=body,
                                              timeout=timeout, headers=headers) as resp:
                    # a node that heartbeats is alive while bytes come; one that does not
                    # is given the batch's work bound
                    phase = "silence" if HEARTBEAT in resp.headers else "work"
                    clock.arm(timer, phase)
                    if resp.status == 200 and resp.content_type == STREAM:
                        await self._read_stream(resp, calls, lambda: clock.arm(timer, phase))
                        return
                    data = await resp.read()
                    status = resp.status
                    ctype = resp.headers.get("Content-Type")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.IncompleteReadError) as exc:
            self.stats["transport_failures"] += 1
            self._mark_down(node, f"transport failure: {exc!r}")
            raise _Retry(f"transport failure: {exc!r}") from None
        except TimeoutError:
            if clock.cause == "budget":
                # this attempt's share of the deadline: the node may well be alive (and slow)
                self.stats["attempt_timeouts"] += 1
                raise _Retry(f"no answer within this attempt's {budget_s:.1f}s") from None
            self.stats["stalls"] += 1
            reason = clock.stall_reason()
            self._mark_down(node, reason)
            raise _Retry(reason) from None
        finally:
            node.outstanding -= len(calls)
        self._settle_whole(node, calls, status, codec_for(ctype), data)

    def _settle_whole(self, node: Node, calls: list[_Call], status: int, codec: Codec,
                      data: bytes) -> None:
        """A node's answer that did not stream: the whole batch's results at once (a node
        without stream support), or an error status. Raises _Retry where another node may
        take the calls (503, an undecodable or short answer); other errors fail the calls."""
        if status == 200:
            try:
                results = codec.result.decode(data).results
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._mark_down(node, f"undecodable answer: {exc}")
                raise _Retry(f"undecodable answer: {exc}") from None
            if len(results) != len(calls):
                reason = f"answer has {len(results)} results for {len(calls)} calls"
                self._mark_down(node, reason)
                raise _Retry(reason)
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
            node.busy_until = time.monotonic() + 0.2
            raise _Retry(f"HTTP 503 {reason}")
        for call in calls:
            if not call.future.done():
                call.future.set_result(ExecResult.failure(
                    f"node {node.url} answered HTTP {status}: {reason}"))

    async def _read_stream(self, resp: aiohttp.ClientResponse, calls: list[_Call],
                           alive: Callable[[], None]) -> None:
        decode = self._codec.frame.decode
        answered = 0
        while answered < len(calls):
            (size,) = FRAME.unpack(await resp.content.readexactly(4))
            alive()
            if size == 0:  # a heartbeat
                continue
            try:
                index, result = decode(await resp.content.readexactly(size))
                call = calls[index]
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as exc:
                raise aiohttp.ClientPayloadError(f"bad frame from node: {exc}") from None
            alive()
            if not call.future.done():
                call.future.set_result(result)
            answered += 1


class _AttemptClock:
    """The one timer of an attempt to one node: the connection and the answer's headers must
    come within the silence limit (``stall_timeout_s``; a streaming node sends them before
    running anything, so at least the connect timeout); then a node that heartbeats may not be
    silent for that long, and one that does not must be done within the batch's work bound;
    nothing goes past the attempt's budget. `cause` says which deadline the timer is armed
    with, so an expiry can say what it means."""

    def __init__(self, loop: asyncio.AbstractEventLoop, silence: float, connect: float,
                 budget_s: float, bound_s: float) -> None:
        self.loop = loop
        self.silence = silence
        self.start = loop.time()
        self.limits = {"budget": self.start + budget_s,
                       "headers": self.start + max(silence, connect),
                       "work": self.start + bound_s}
        self.bound_s = bound_s
        self.cause = "headers"

    def arm(self, timer: asyncio.Timeout, phase: str) -> None:
        """Re-arm `timer` for `phase` ("headers", "silence": from now, "work"): the earliest of
        the phase's deadline and the budget (on a tie the phase's, which says more)."""
        at = self.loop.time() + self.silence if phase == "silence" else self.limits[phase]
        budget = self.limits["budget"]
        self.cause, at = (phase, at) if at <= budget else ("budget", budget)
        timer.reschedule(at)

    def stall_reason(self) -> str:
        """Why the node is taken down, for an expiry that is not the budget's."""
        return {
            "headers": f"no answer to the request within "
                       f"{self.limits['headers'] - self.start:g}s",
            "silence": f"silent for {self.silence:g}s (no result, no heartbeat)",
            "work": f"no answer within {self.bound_s:.1f}s, the batch's work bound (the node "
                    "sends no heartbeats)",
        }[self.cause]
