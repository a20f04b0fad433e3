"""Load reporting of remote engines: one scrape per `load_ttl_s`, shared by concurrent callers.

Owns: `LoadCache` (the last scrape and when it was taken; a pure value) and `LoadReporter`
(serves the cached value while fresh, lets one caller scrape while the others wait for its
result, and answers one failed scrape with the last value, aged, rather than an error).

Does not own: how a server's load is read (the `fetch` callable, a subclass's `_fetch_load`),
whether the server is up (`remote.RemoteEngine.load` checks first), or what a failed scrape
says about its health (the `on_trouble` callback asks for a probe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec

from asyncrl.engine.base import EngineLoad
from asyncrl.errors import EngineUnavailable


class LoadCache:
    """The last load scrape and when it was taken; a pure value, no I/O."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.value: EngineLoad | None = None
        self.at = float("-inf")

    def fresh(self, now: float) -> bool:
        return self.value is not None and now - self.at < self.ttl_s

    def put(self, value: EngineLoad, now: float) -> None:
        self.value, self.at = value, now

    def clear(self) -> None:
        self.value, self.at = None, float("-inf")

    def aged(self, now: float) -> EngineLoad:
        """The cached value, its `age_s` grown by the time it spent here."""
        assert self.value is not None
        return msgspec.structs.replace(self.value, age_s=self.value.age_s + (now - self.at))


class LoadReporter:
    """One server's load, scraped by `fetch` at most once per `ttl_s`.

    `on_trouble` is called when a scrape finds the server unreachable (the engine then probes
    its health at once).
    """

    def __init__(self, ttl_s: float, fetch: Callable[[], Awaitable[EngineLoad]],
                 on_trouble: Callable[[], None]) -> None:
        self._cache = LoadCache(ttl_s)
        self._fetch = fetch
        self._on_trouble = on_trouble
        self._lock = asyncio.Lock()

    def clear(self) -> None:
        """Forget the last scrape (the server went down or came back: it is stale)."""
        self._cache.clear()

    async def get(self) -> EngineLoad:
        loop = asyncio.get_running_loop()
        if self._cache.fresh(loop.time()):
            return self._cache.aged(loop.time())
        async with self._lock:
            if self._cache.fresh(loop.time()):  # scraped by the caller we waited for
                return self._cache.aged(loop.time())
            try:
                value = await self._fetch()
            except EngineUnavailable:
                self._on_trouble()
                if self._cache.value is not None:  # one failed scrape: last value, probe now
                    return self._cache.aged(loop.time())
                raise
            self._cache.put(value, loop.time())
            return value
