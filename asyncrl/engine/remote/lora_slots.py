"""The LoRA adapters one inference server holds, as both server kinds keep them.

Owns: `AdapterSlots`: which adapter new requests are served with (`current`: name and version),
the adapters loaded on the server (oldest first), the version each in-flight request was sent
with (so its tokens are tagged with it, whatever loads meanwhile), the version of the base the
server holds (an adapter trained over another base is refused), the reset after a (re)launch,
and unloading all but the last two adapters (the previous one may still serve requests).

Does not own: the server calls that load and unload an adapter (each engine passes its own as
callables: SGLang's `/load_lora_adapter`, vLLM's `/v1/load_lora_adapter`), or how a request
names its adapter on the wire (SGLang's `lora_path`, vLLM's `model`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.engine.base import TokenDelta, WeightUpdate
from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

KEEP = 2
"""Adapters left loaded after an update: the new one and the previous one, whose requests may
still be running."""


def adapter_name(version: int) -> str:
    """The name an adapter of `version` is loaded under."""
    return f"asyncrl-v{version}"


class AdapterSlots:
    """One server's LoRA adapters (see the module docstring)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.current: tuple[str, int] | None = None
        """(name, version) of the adapter new requests are served with; None = the base."""
        self.loaded: list[str] = []
        """Adapters loaded on the server, oldest first."""
        self.base_version = 0
        """Version of the base weights the server holds."""
        self._sent_with: dict[str, int] = {}
        """Request id -> the adapter version it was sent with (until its stream ends)."""

    def reset(self, base_version: int) -> None:
        """A (re)launched server: it holds the base it was started from and no adapter."""
        self.current, self.loaded = None, []
        self.base_version = base_version

    def base_replaced(self, version: int) -> None:
        """New base weights were loaded: requests go to them until an adapter is loaded."""
        self.base_version, self.current = version, None

    def check(self, update: WeightUpdate) -> None:
        """Refuse an adapter-only update trained over a base the server does not hold."""
        if update.adapter_path and not update.has_base \
                and update.base_version != self.base_version:
            raise WeightSyncError(f"{self.engine}: adapter trained over the base of version "
                                  f"{update.base_version}, the server holds version "
                                  f"{self.base_version}'s; send the base with it")

    # ------------------------------------------------------------------------ requests
    def send(self, request_id: str) -> str | None:
        """The adapter name to send `request_id` with (None: the base), remembering its
        version for the request's tokens."""
        if self.current is None:
            return None
        self._sent_with[request_id] = self.current[1]
        return self.current[0]

    def stamp(self, request_id: str, state: dict[str, Any], delta: TokenDelta | None) -> None:
        """Tag the stream's tokens (`state["version"]`) with the adapter version the request
        was sent with; forget the request once its stream finishes."""
        version = self._sent_with.get(request_id)
        if version is not None:
            state["version"] = version
            if delta is not None and delta.finish_reason is not None:
                del self._sent_with[request_id]

    def forget(self, request_id: str) -> None:
        """An aborted request."""
        self._sent_with.pop(request_id, None)

    # ------------------------------------------------------------------------ adapters
    async def load(self, update: WeightUpdate,
                   load: Callable[[str, str], Awaitable[None]],
                   unload: Callable[[str], Awaitable[None]]) -> None:
        """Load `update`'s adapter directory (`load(name, path)`) and serve new requests
        with it; the same version again (a retried push) is unloaded first."""
        name = adapter_name(update.version)
        if name in self.loaded:
            await unload(name)
            self.loaded.remove(name)
        await load(name, update.adapter_path)
        self.loaded.append(name)
        self.current = (name, update.version)

    async def unload_stale(self, unload: Callable[[str], Awaitable[None]],
                           alive: Callable[[], bool] = lambda: True) -> None:
        """Unload every adapter older than the previous one, oldest first, while `alive()`.
        A failure costs only memory: it is logged and the rest wait for the next update."""
        while len(self.loaded) > KEEP and alive():
            try:
                await unload(self.loaded[0])
            except (WeightSyncError, EngineError) as e:
                log.warning("lora_unload_failed", engine=self.engine, adapter=self.loaded[0],
                            error=str(e))
                return
            self.loaded.pop(0)
