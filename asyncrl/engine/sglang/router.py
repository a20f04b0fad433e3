"""sglang-router in front of SGLang servers: one engine to the scheduler.

Owns: `RoutedSGLangEngine` (generation through the router, which keeps prefix-cache affinity
across servers; its streams are the routed engine's own, so a server going down breaks only
those the router gave it; load summed over servers; abort and weight updates sent to every
server; a server whose update failed taken out of the router, so no request lands on its old
weights, and put back once an update succeeds) and registering servers with the router. For a weight
push each server counts as an engine: the routed engine fails an update only when every
server behind it failed. Does not own: a server's wire format or
supervision (`sglang.SGLangEngine`; the router needs only what every `remote.RemoteEngine`
has, so it does not import `sglang`), or building a fleet from config (`sglang_fleet`).

Registration follows sglang-router 0.3.2 (the `gpu` extra's pin), which has no `/add_worker`:
`POST /workers {"url"}` answers 202 and adds the worker in the background; the worker is ready
once `GET /workers` lists it with `is_healthy: true`. The router health-checks workers itself
(its `/health` probes hit a paused server too); asyncrl's own supervision of each server is
unchanged behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate, push_to_all
from asyncrl.engine.remote.engine import RemoteEngine, open_all
from asyncrl.engine.remote.stream import StreamGuard
from asyncrl.errors import EngineError, EngineUnavailable, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)


class RoutedSGLangEngine:
    """SGLang servers behind an sglang-router: one engine to the scheduler.

    Down while no server is up. Servers asyncrl launched are registered with the router on
    start (`register=True`); attached ones are assumed registered already.
    """

    kind = "sglang"

    def __init__(self, router_url: str, servers: Sequence[RemoteEngine], *,
                 register: bool = False) -> None:
        self.name = "sglang-router"
        self.router_url = router_url.rstrip("/")
        self.servers = list(servers)
        self._register = register
        self._stack: contextlib.AsyncExitStack | None = None
        self._out: set[str] = set()
        """Names of servers taken out of the router after a failed weight update."""
        self._streams = StreamGuard(self.name, version=lambda: self.policy_version,
                                    down_reason=lambda: "closed", on_trouble=self._probe_all,
                                    on_refused=lambda reason: self._probe_all())
        """The streams through the router, whichever server it picked: one server going down
        cuts none of them (the router's own stream to it breaks), the router's close all."""

    @property
    def in_service(self) -> list[RemoteEngine]:
        """The servers the router sends requests to (all but those taken out)."""
        return [s for s in self.servers if s.name not in self._out]

    @property
    def policy_version(self) -> int:
        return min(s.policy_version for s in self.in_service or self.servers)

    @property
    def healthy(self) -> bool:
        return any(s.healthy for s in self.in_service)

    async def __aenter__(self) -> RoutedSGLangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(open_all(self.servers))
            if self._register:
                for s in self.servers:
                    await register_worker(s.session, self.router_url, s.url,
                                          timeout_s=s.options.startup_timeout_s)
        except BaseException:
            await asyncio.shield(stack.aclose())
            raise
        self._stack = stack

    async def close(self) -> None:
        self._streams.cut_all("down")
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await asyncio.shield(stack.aclose())

    def _any(self) -> RemoteEngine:
        for s in self.in_service:
            if s.healthy:
                return s
        raise EngineUnavailable("no SGLang server behind the router is up")

    def _probe_all(self) -> None:
        """A stream through the router broke: have every server probed now."""
        for s in self.in_service:
            s.probe_soon()

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self._any().stream_via(self.router_url, request, self._streams)

    async def abort(self, request_id: str) -> None:
        self._streams.note_abort(request_id)
        await asyncio.gather(*(s.abort(request_id) for s in self.servers if s.healthy))
        self._streams.cut(request_id, "abort")

    async def load(self) -> EngineLoad:
        loads = []
        for s in self.in_service:
            if s.healthy:
                try:
                    loads.append(await s.load())
                except EngineUnavailable:
                    continue
        if not loads:
            raise EngineUnavailable("no SGLang server behind the router is up")
        return EngineLoad(kv_tokens_used=sum(x.kv_tokens_used for x in loads),
                          kv_tokens_capacity=sum(x.kv_tokens_capacity for x in loads),
                          running=sum(x.running for x in loads),
                          waiting=sum(x.waiting for x in loads),
                          age_s=max(x.age_s for x in loads))

    async def update_weights(self, update: WeightUpdate) -> None:
        """Update every server, those taken out included; one server's failure does not stop
        the others'. A server that failed is taken out of the router (it keeps its old
        weights; its requests in flight finish under their old version tags); one taken out
        earlier that now succeeds is put back. Raises `WeightSyncError` only when no server
        took the weights, naming each failure."""
        await self.record_update(dict(await push_to_all(self.servers, update)),
                                 update.version)

    async def record_update(self, failed: dict[str, WeightSyncError], version: int) -> None:
        """After an update of the servers (by `update_weights`, or by a caller that updated
        them itself, as `weight_group` does): take the failed ones out of the router and put
        back those that succeeded. Raises `WeightSyncError` when every server failed."""
        if len(failed) == len(self.servers):
            raise WeightSyncError("; ".join(f"{n}: {r}" for n, r in failed.items()))
        for s in self.servers:
            if s.name in failed and s.name not in self._out:
                log.error("sglang_worker_taken_out", engine=s.name, url=s.url,
                          version=version, error=str(failed[s.name]))
                self._out.add(s.name)
                await self._deregister(s)
            elif s.name not in failed and s.name in self._out:
                try:
                    await register_worker(s.session, self.router_url, s.url,
                                          timeout_s=s.options.startup_timeout_s)
                except (EngineError, EngineUnavailable) as e:
                    log.warning("sglang_worker_not_put_back", engine=s.name, error=str(e))
                    continue
                self._out.discard(s.name)
                log.info("sglang_worker_put_back", engine=s.name, version=version)

    async def _deregister(self, server: RemoteEngine) -> None:
        """`DELETE {router}/workers/{id}`: 0.3.2 names a worker by the UUID `GET /workers`
        lists with its url (a url in the path is a 400), and removes it in the background.
        A router that refuses is logged: the server stays out of asyncrl's own accounting
        either way."""
        want = server.url.rstrip("/")
        try:
            async with asyncio.timeout(server.options.control_timeout_s):
                async with server.session.get(f"{self.router_url}/workers") as resp:
                    entries = _workers(orjson.loads(await resp.read()))
                ids = [str(w["id"]) for w in entries
                       if str(w.get("url", "")).rstrip("/") == want and w.get("id")]
                for wid in ids or [server.url]:
                    path = urllib.parse.quote(wid, safe="")
                    async with server.session.delete(f"{self.router_url}/workers/{path}") as r:
                        body = await r.read()
                        if r.status not in (200, 202, 204):
                            log.warning("sglang_router_refused_removal", engine=server.name,
                                        status=r.status,
                                        body=body[:200].decode(errors="replace"))
        except (aiohttp.ClientError, TimeoutError, EngineError, orjson.JSONDecodeError) as e:
            log.warning("sglang_router_removal_failed", engine=server.name, error=repr(e))


def _workers(data: Any) -> list[dict[str, Any]]:
    """The worker entries of a `GET /workers` reply (`{"workers": [...], ...}`)."""
    items = data.get("workers") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise EngineError(f"unrecognised GET /workers reply: {str(data)[:200]}")
    return [w for w in items if isinstance(w, dict)]


async def register_worker(session: aiohttp.ClientSession, router_url: str, url: str, *,
                          timeout_s: float, poll_s: float = 0.5) -> None:
    """Add `url` to the router and wait until the router reports it healthy.

    `POST /workers` is accepted with 200/201/202 (0.3.2 answers 202 and adds the worker
    asynchronously); then `GET /workers` is polled until an entry with this url has
    `is_healthy: true`. Raises `EngineError` when the router refuses (with its message) and
    `EngineUnavailable` when it is unreachable or the worker is not healthy within
    `timeout_s`.
    """
    want = url.rstrip("/")
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{router_url}/workers", json={"url": url}) as resp:
                body = await resp.read()
                if resp.status not in (200, 201, 202):
                    raise EngineError(f"router refused {url}: HTTP {resp.status}: "
                                      f"{body[:300].decode(errors='replace')}")
            while True:
                async with session.get(f"{router_url}/workers") as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise EngineError(f"router GET /workers -> HTTP {resp.status}: "
                                          f"{raw[:300].decode(errors='replace')}")
                try:
                    entries = _workers(orjson.loads(raw))
                except orjson.JSONDecodeError as e:
                    raise EngineError(f"router GET /workers returned non-JSON: "
                                      f"{raw[:200]!r}") from e
                if any(str(w.get("url", "")).rstrip("/") == want and w.get("is_healthy")
                       for w in entries):
                    return
                await asyncio.sleep(poll_s)
    except TimeoutError as e:
        raise EngineUnavailable(f"sglang-router at {router_url} did not report {url} healthy "
                                f"within {timeout_s:.0f}s") from e
    except aiohttp.ClientError as e:
        raise EngineUnavailable(f"sglang-router at {router_url} unreachable: {e}") from e
