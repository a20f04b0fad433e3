"""HTTP transport of remote engines: one call to one server, with a deadline and a retry rule.

Owns: control calls (`control_call`: a deadline on each try; retried on connection errors and
timeouts only, with capped exponential backoff; the last failure becomes `EngineUnavailable`),
reading a JSON reply (`json_reply`: not HTTP 200 or not JSON is an `EngineError`), health
probes (`probe`: any transient failure reads as "not healthy"), and the mapping of a refused
generation request's status to the error vocabulary (`http_error`). Pure functions over an
aiohttp session passed in; no state.

Does not own: which calls may be retried (the caller passes `retries`; only idempotent
control calls pass more than 0, a generation request is never retried), what a failure means
for the server's health (`remote.RemoteEngine`), or any server's endpoints.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from asyncrl.errors import EngineError, EngineOverloaded, EngineUnavailable

TRANSIENT = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""Failures worth one more try on an idempotent call (and the signature of a sick server)."""


async def control_call(session: aiohttp.ClientSession, base_url: str, method: str, path: str,
                       *, name: str, timeout_s: float, json: Any = None,
                       params: dict[str, str] | None = None,
                       retries: int = 0) -> tuple[int, bytes]:
    """(status, body) of one call to `base_url + path`, each try under `timeout_s`.

    `name` (the engine's) prefixes the `EngineUnavailable` raised once every try failed.
    """
    for attempt in range(retries + 1):
        try:
            async with asyncio.timeout(timeout_s):
                async with session.request(method, base_url + path, json=json,
                                           params=params) as resp:
                    return resp.status, await resp.read()
        except TRANSIENT as e:
            if attempt == retries:
                raise EngineUnavailable(
                    f"{name}: {method} {path} failed: {type(e).__name__}: {e}") from e
            await asyncio.sleep(min(0.25 * 2 ** attempt, 2.0))
    raise AssertionError("unreachable")


def json_reply(name: str, method: str, path: str, status: int, body: bytes) -> Any:
    """The JSON of a control call's reply (None for an empty body); `EngineError` unless the
    status is 200 and the body is JSON."""
    if status != 200:
        raise EngineError(f"{name}: {method} {path} -> HTTP {status}: "
                          f"{body[:300].decode(errors='replace')}")
    try:
        return orjson.loads(body) if body else None
    except orjson.JSONDecodeError as e:
        raise EngineError(f"{name}: {path} returned non-JSON: {body[:200]!r}") from e


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Whether GET `url` answers 200 within `timeout_s` (a transient failure is a no)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url) as resp:
                await resp.read()
                return resp.status == 200
    except TRANSIENT:
        return False


def http_error(name: str, status: int, body: bytes) -> EngineError:
    """The error for a generation request the server answered with `status` (not 200):
    429 is `EngineOverloaded`, 5xx `EngineUnavailable` (the server is sick), else
    `EngineError` (it rejected this request)."""
    text = body[:500].decode(errors="replace")
    if status == 429:
        return EngineOverloaded(f"{name}: HTTP 429: {text}")
    if status >= 500:
        return EngineUnavailable(f"{name}: HTTP {status}: {text}")
    return EngineError(f"{name}: HTTP {status}: {text}")
