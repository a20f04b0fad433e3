"""The stream guard of remote engines: one server's (or one router's) open generation
streams, read safely.

Owns: the table of open streams (each with a `StreamCtl` that lets an abort or a down server
cut a wait on the network at once), the ids aborted while streaming and those aborted before
their stream began (bounded, oldest forgotten first), and `StreamGuard.stream`, which posts
one generation request and yields its token deltas: every network wait has a deadline (the
request's whole budget) and none runs while the consumer holds a delta; SSE framing; the
finish delta held back until `[DONE]` (waited for briefly); the connection closed (the
server drops the request) unless the stream ran to `[DONE]`; the failure vocabulary of a
stream (`EngineUnavailable` when the server is down, refused or stopped answering,
`EngineError` when it rejected the request or sent a malformed event).

Does not own: the wire format (the `decode` and request-body hooks of a `RemoteEngine`
subclass), whether the server is up (checked by `RemoteEngine.stream_via` before a stream
starts), or what trouble means for the server (the `on_trouble` and `on_refused` callbacks:
probe it now, take it out of service).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
import orjson

from asyncrl.engine.base import GenerateRequest, TokenDelta
from asyncrl.engine.remote.http import http_error
from asyncrl.engine.remote.wire import SSEDecoder
from asyncrl.errors import EngineError, EngineUnavailable

EARLY_ABORTS_KEPT = 4096
"""Ids aborted before their stream started that are remembered (oldest forgotten first)."""

Decode = Callable[[dict[str, Any], dict[str, Any]], TokenDelta | None]
"""One SSE event and the stream's state → the new tokens (or None); see
`RemoteEngine._decode`. The state's `aborting` says whether the stream was aborted (its
server may then end it with "abort")."""


class StreamCtl:
    """Lets `abort` and `mark_down` cut a stream that is waiting on the network."""

    __slots__ = ("cut_reason", "request_id", "timeout")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.timeout: asyncio.Timeout | None = None
        self.cut_reason: str | None = None  # "abort" | "down"

    def cut(self, reason: str) -> None:
        if self.cut_reason is None:
            self.cut_reason = reason
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())


def finish_delta(reason: str, version: int) -> TokenDelta:
    return TokenDelta(token_ids=[], logprobs=[], finish_reason=reason, policy_version=version)


class StreamGuard:
    """The open streams of one server, or of a router in front of several (engine `name`).

    `version()` is the engine's current policy version (the tag of tokens the server did not
    tag itself), `down_reason()` why it is down; `on_trouble()` asks for a health probe now,
    `on_refused(reason)` takes the server out of service (it refused a connection).
    """

    def __init__(self, name: str, *, version: Callable[[], int],
                 down_reason: Callable[[], str], on_trouble: Callable[[], None],
                 on_refused: Callable[[str], None]) -> None:
        self.name = name
        self._version = version
        self._down_reason = down_reason
        self._on_trouble = on_trouble
        self._on_refused = on_refused
        self._open: dict[str, StreamCtl] = {}
        self._aborted: set[str] = set()
        self._early_aborts: dict[str, None] = {}
        """Ids aborted before their stream started (bounded, oldest dropped): such a stream
        ends at once with "abort" instead of running to the end."""

    def __len__(self) -> int:
        """Streams open now."""
        return len(self._open)

    def take_early_abort(self, request_id: str) -> bool:
        """Whether `request_id` was aborted before its stream started (forgotten now)."""
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            return True
        return False

    def note_abort(self, request_id: str) -> None:
        """Record an abort, before the server is asked: an open stream then ends with "abort",
        a stream not started yet ends at once when it starts."""
        if request_id in self._open:
            self._aborted.add(request_id)
        else:
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > EARLY_ABORTS_KEPT:
                del self._early_aborts[next(iter(self._early_aborts))]

    def cut(self, request_id: str, reason: str) -> None:
        """Cut the stream of `request_id` if it is open ("abort" | "down")."""
        ctl = self._open.get(request_id)
        if ctl is not None:
            ctl.cut(reason)

    def cut_all(self, reason: str) -> None:
        for ctl in list(self._open.values()):
            ctl.cut(reason)

    def _http_error(self, status: int, body: bytes) -> EngineError:
        if status >= 500:
            self._on_trouble()
        return http_error(self.name, status, body)

    def _last_delta(self, ctl: StreamCtl, request: GenerateRequest,
                    final: TokenDelta | None) -> TokenDelta:
        """The delta that ends a stream once reading stopped: the finish event, an abort's
        ending, or (raised) why there is none: the server went down, or the stream ended
        without a finish reason."""
        if final is not None:
            return final
        if ctl.cut_reason == "abort" or request.request_id in self._aborted:
            return finish_delta("abort", self._version())
        if ctl.cut_reason == "down":
            raise EngineUnavailable(f"{self.name} went down: {self._down_reason()}")
        self._on_trouble()
        raise EngineUnavailable(f"{self.name}: stream {request.request_id} ended "
                                "without a finish reason")

    async def stream(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     request: GenerateRequest, *, timeout_s: float,
                     decode: Decode) -> AsyncGenerator[TokenDelta, None]:
        """POST `body` to `url` and yield the deltas of `request`, within `timeout_s`."""
        ctl = StreamCtl(request.request_id)
        self._open[request.request_id] = ctl
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        decoder, state = SSEDecoder(), {"n": 0, "request": request, "done": False}
        resp: aiohttp.ClientResponse | None = None
        final: TokenDelta | None = None
        try:
            try:
                # `ctl.timeout` is set only while its block runs: a stream failing out of the
                # block (connection refused) marks the server down, which cuts every stream
                try:
                    async with asyncio.timeout_at(deadline) as ctl.timeout:
                        resp = await _post(session, url, body)
                        if resp.status != 200:
                            raise self._http_error(resp.status, await resp.read())
                finally:
                    ctl.timeout = None
                while not state["done"] and ctl.cut_reason is None:
                    # After the finish event only [DONE] is missing: wait briefly for it.
                    until = deadline if final is None else min(deadline, loop.time() + 5.0)
                    try:
                        async with asyncio.timeout_at(until) as ctl.timeout:
                            chunk = await resp.content.readany()
                    finally:
                        ctl.timeout = None
                    if not chunk:
                        break
                    for data in decoder.feed(chunk):
                        if ctl.cut_reason is not None:
                            break  # cut while we held a delta: nothing more is yielded
                        if data == b"[DONE]":
                            state["done"] = True
                            break
                        state["version"] = None
                        state["aborting"] = request.request_id in self._aborted
                        delta = decode(orjson.loads(data), state)
                        if delta is None or final is not None:
                            continue
                        # the server's own tag of these tokens when it gives one (tokens
                        # made before an update but read after it keep the old version)
                        v = state["version"]
                        delta.policy_version = v if isinstance(v, int) else self._version()
                        if delta.finish_reason is not None:
                            final = delta
                        else:
                            yield delta
            except TimeoutError:
                if ctl.cut_reason is None and final is None:
                    self._on_trouble()
                    raise EngineUnavailable(f"{self.name}: request {request.request_id} "
                                            f"exceeded {timeout_s:.0f}s") from None
            except aiohttp.ClientConnectorError as e:
                self._on_refused(f"connection refused: {e}")
                raise EngineUnavailable(f"{self.name} unreachable: {e}") from e
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                if ctl.cut_reason is None and final is None:
                    self._on_trouble()
                    raise EngineUnavailable(
                        f"{self.name}: stream {request.request_id} broke: {e!r}") from e
            except orjson.JSONDecodeError as e:
                raise EngineError(f"{self.name}: malformed stream event: {e}") from e
            yield self._last_delta(ctl, request, final)
        finally:
            self._open.pop(request.request_id, None)
            self._aborted.discard(request.request_id)
            if resp is not None:
                if state["done"]:
                    resp.release()
                else:
                    resp.close()


STALE_CONNECTION_RETRIES = 2
"""Sends of one request again after its pooled connection was found closed (see `_post`)."""


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> aiohttp.ClientResponse:
    """`session.post`, sent again on a new connection when the pooled keep-alive connection it
    took had been closed by the server while idle (uvicorn, under vLLM, closes idle ones
    after 5 s, so a wave that starts after a longer weight update meets them: "Can not write
    request body", or the server disconnecting before it answers). No response came back,
    so the server did not take the request; a refused connection is not retried (the server
    is down, which the caller handles)."""
    for attempt in range(STALE_CONNECTION_RETRIES + 1):
        try:
            return await session.post(url, json=body)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            if attempt == STALE_CONNECTION_RETRIES:
                raise
    raise AssertionError("unreachable")
