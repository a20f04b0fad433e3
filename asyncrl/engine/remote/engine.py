"""Remote engines: one inference server (SGLang, vLLM) over HTTP behind the engine protocol.

Owns: `RemoteEngine`'s lifecycle and supervision: launching a server as a child process or
attaching to one by URL; waiting for health; supervising it (a server that exits or fails its
health checks is marked down, every stream on it is cut with `EngineUnavailable`, and a server
asyncrl launched is relaunched with the latest weights; while a weight update is in progress a
server blocked loading weights may answer its health check late or with a 503, so only its
liveness is probed then (`update_liveness_path`), and the update has its own deadline,
`weight_timeout_s`); the pause → apply → flush → resume sequence around weight updates; the
hooks a subclass fills in with its server's wire format; and `open_all` (start engines
together, close them all).

The parts it is built from, one concept each: `remote_options` (the process-level knobs),
`server_process` (the child process), `remote_http` (control calls: deadlines, retries, error
translation), `remote_stream` (the stream guard: open streams, deadlines, aborts, SSE
reading), `remote_load` (the load cache), `http_wire` (SSE and Prometheus parsing).

Does not own: any server's wire format (`sglang/engine.py`, `vllm/engine.py` subclass `ServerEngine`),
fanning an update out to several engines (`weightsync`), or what happens to a rollout whose
stream raised `EngineUnavailable` (the scheduler requeues it from its last completed turn on
another engine).

Failure vocabulary at this edge: aiohttp and timeout errors become `EngineUnavailable` (the
server is down, refused, or stopped answering) or `EngineError` (the server rejected this
request); failed weight updates become `WeightSyncError`. Only idempotent control calls
(load scrapes, aborts, health probes) are retried, on connection errors and timeouts, with
capped exponential backoff; a generation request is never retried here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.engine.remote import http as remote_http
from asyncrl.engine.remote.load import LoadCache, LoadReporter
from asyncrl.engine.remote.lora_slots import AdapterSlots
from asyncrl.engine.remote.options import RemoteOptions, with_log_dir
from asyncrl.engine.remote.process import ServerProcess
from asyncrl.engine.remote.stream import StreamGuard, finish_delta
from asyncrl.errors import EngineError, EngineUnavailable, WeightSyncError
from asyncrl.log import get_logger

# LoadCache, RemoteOptions, with_log_dir and finish_delta are re-exported: callers (engine
# modules, tests, benches) import them from here.
__all__ = ["LoadCache", "RemoteEngine", "RemoteOptions", "finish_delta", "open_all",
           "with_log_dir"]

log = get_logger(__name__)


# ------------------------------------------------------------------------------ engine
class RemoteEngine:
    """One inference server behind the `Engine` protocol. Subclasses speak its wire format.

    Use as `async with engine:` (or `await engine.start()` / `await engine.close()`).
    `healthy` is False while the server is down; `stream` and `load` then raise
    `EngineUnavailable` at once, and a launched server is being relaunched.
    """

    kind = "remote"
    health_path = "/health"
    update_liveness_path: str | None = None
    """Probed instead of `health_path` while a weight update is in progress, when the health
    check cannot pass then (SGLang's generates a token): an endpoint the server's HTTP front
    answers without its scheduler. None: `health_path` is probed during updates too."""
    env_unset: tuple[str, ...] = ()
    """Environment variables removed from a launched server's environment (ones that would
    break the engine's contract, e.g. SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB)."""

    def __init__(self, *, name: str, session: aiohttp.ClientSession | None = None,
                 url: str = "", model_path: str = "", port: int = 0,
                 request_timeout_s: float = 3600.0, options: RemoteOptions | None = None) -> None:
        self.name = name
        self.policy_version = 0
        self.options = options or RemoteOptions()
        self._given_session = session
        self._session: aiohttp.ClientSession = session  # type: ignore[assignment]
        self.on_state: Callable[[str, bool], None] | None = None
        """Called with (name, up) whenever the server goes down or comes back (e.g. to take
        the engine out of a scheduler and `revive` it)."""
        self._launched = not url
        self.port = port
        self.url = (url or f"http://{self.options.host}:{port}").rstrip("/")
        self._model_path = model_path
        self._weights: tuple[str, int] | None = (model_path, 0) if model_path else None
        """Latest disk weights (path, version): what a relaunch loads."""
        self._request_timeout_s = request_timeout_s
        self._proc: ServerProcess | None = None
        self._up = False
        self._down_reason = "not started"
        self._closed = False
        self._restarts = 0
        self._probe_now = asyncio.Event()
        """Set to have the supervisor probe at once (a stream or scrape saw trouble)."""
        # The stream guard and the load reporter read this engine's state through callbacks
        # (the version tags untagged tokens, a refused connection takes the server down).
        self._streams = StreamGuard(name, version=lambda: self.policy_version,
                                    down_reason=lambda: self._down_reason,
                                    on_trouble=self._probe_now.set, on_refused=self.mark_down)
        self._load = LoadReporter(self.options.load_ttl_s, lambda: self._fetch_load(),
                                  on_trouble=self._probe_now.set)
        self._update_lock = asyncio.Lock()
        self._relaunch_lock = asyncio.Lock()
        self._supervisor: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- hooks for subclasses
    def _argv(self, model_path: str) -> list[str]:
        """Launch command for this server loading `model_path`."""
        raise NotImplementedError

    def _server_env(self) -> dict[str, str]:
        return {}

    async def _on_ready(self) -> None:
        """Read what the server tells about itself (KV capacity, streaming mode)."""

    def _request(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a streaming generation request."""
        raise NotImplementedError

    def _decode(self, event: dict[str, Any], state: dict[str, Any]) -> TokenDelta | None:
        """One SSE event → the new tokens (or None); raise `EngineError` for an error event."""
        raise NotImplementedError

    async def _fetch_load(self) -> EngineLoad:
        raise NotImplementedError

    async def _server_abort(self, request_id: str) -> None:
        """Ask the server to abort; the local stream is cut regardless."""

    async def _pause(self) -> None:
        """Stop scheduling; keep in-flight requests (they continue on the new weights)."""

    async def _resume(self) -> None: ...

    async def _apply(self, update: WeightUpdate) -> None:
        raise NotImplementedError

    async def _flush(self) -> None:
        """Drop the prefix cache (it holds KV computed by the old weights)."""

    # ------------------------------------------------------------------------ lifecycle
    @property
    def healthy(self) -> bool:
        return self._up

    @property
    def updating(self) -> bool:
        """A weight update is in progress (pause, load, flush, resume)."""
        return self._update_lock.locked()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    @property
    def launched(self) -> bool:
        return self._launched

    @property
    def process(self) -> ServerProcess | None:
        return self._proc

    async def __aenter__(self) -> RemoteEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Launch (or reach) the server, wait until it is healthy, start supervising it.

        Without a session passed in, the engine opens its own here and closes it in `close`.
        """
        if self._given_session is None:
            self._session = aiohttp.ClientSession()
        try:
            if self._launched:
                await self._launch()
            await self._wait_ready()
            await self._on_ready()
        except BaseException:
            await asyncio.shield(self._stop_process())
            if self._given_session is None:
                await self._session.close()
            raise
        self._mark_up()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"{self.name}-supervisor")

    async def close(self) -> None:
        """Stop supervising, cut open streams, stop a launched server. Survives cancellation."""
        if self._closed:
            return
        self._closed = True
        self._up, self._down_reason = False, "closed"
        self._streams.cut_all("down")
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._supervisor)
        await asyncio.shield(self._stop_process())
        if self._given_session is None and self._session is not None:
            await self._session.close()

    async def _stop_process(self) -> None:
        if self._proc is not None:
            await self._proc.stop(self.options.stop_grace_s)

    def _log_path(self) -> Path:
        base = Path(self.options.log_dir or Path(tempfile.gettempdir()) / "asyncrl-engines")
        return base / f"{self.name}.log"

    async def _launch(self) -> None:
        path = self._weights[0] if self._weights else self._model_path
        env = {**os.environ, **self._server_env(), **self.options.env}
        for key in self.env_unset:
            env.pop(key, None)
        self._proc = ServerProcess(self._argv(path), env=env, log_path=self._log_path(),
                                   name=self.name)
        await self._proc.start()

    def _launch_prefix(self, module: str) -> list[str]:
        if self.options.launcher:
            return list(self.options.launcher)
        return [self.options.python or sys.executable, "-m", module]

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.startup_timeout_s
        while True:
            if self._proc is not None and not self._proc.running:
                raise EngineUnavailable(
                    f"{self.name} exited during startup (rc={self._proc.returncode}); "
                    f"log {self._proc.log_path}:\n{self._proc.log_tail()}")
            if await self._probe(timeout_s=min(self.options.health_timeout_s, 10.0)):
                return
            if loop.time() > deadline:
                tail = self._proc.log_tail() if self._proc else ""
                raise EngineUnavailable(
                    f"{self.name} at {self.url} not healthy after "
                    f"{self.options.startup_timeout_s:.0f}s\n{tail}")
            await asyncio.sleep(0.5)

    async def _probe(self, timeout_s: float | None = None, path: str | None = None) -> bool:
        return await remote_http.probe(self._session, self.url + (path or self.health_path),
                                       timeout_s or self.options.health_timeout_s)

    # ----------------------------------------------------------------------- supervision
    def _mark_up(self) -> None:
        self._up, self._down_reason = True, ""
        self._load.clear()
        log.info("engine_up", engine=self.name, url=self.url, policy_version=self.policy_version)
        self._notify(True)

    def _notify(self, up: bool) -> None:
        if self.on_state is not None:
            try:
                self.on_state(self.name, up)
            except Exception:  # a listener's bug must not stop supervision
                log.exception("engine_state_listener_failed", engine=self.name)

    def probe_soon(self) -> None:
        """Have the supervisor probe the server now (something in front of it saw trouble)."""
        self._probe_now.set()

    def mark_down(self, reason: str) -> None:
        """Take the server out of service: cut its streams (they raise EngineUnavailable)."""
        if not self._up:
            return
        self._up, self._down_reason = False, reason
        self._load.clear()
        self._streams.cut_all("down")
        self._probe_now.set()
        log.warning("engine_down", engine=self.name, url=self.url, reason=reason,
                    in_flight=len(self._streams))
        self._notify(False)

    async def _supervise(self) -> None:
        """Probe every `health_interval_s` (at once when a stream or scrape saw trouble)."""
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.health_interval_s):
                    await self._probe_now.wait()
            self._probe_now.clear()
            try:
                failures = await self._check(failures)
            except Exception:  # a bug here must not end supervision of a live server
                log.exception("engine_supervisor_error", engine=self.name)

    async def _check(self, failures: int) -> int:
        """One supervision round; returns the count of consecutive failed probes."""
        if self._proc is not None and not self._proc.running:
            self.mark_down(f"server process exited (rc={self._proc.returncode})")
            await self._restart()
            return 0
        if self._up and self.updating and self.update_liveness_path is not None:
            # Loading weights blocks the server's health check (SGLang answers 503 after
            # 20 s): only ask whether the server still answers at all. The update has its own
            # deadline and reports its own failure.
            if await self._probe(path=self.update_liveness_path):
                return 0
        elif await self._probe():
            if not self._up:
                await self._recover()
            return 0
        failures += 1
        if failures >= self.options.health_failures or not self._up:
            self.mark_down(f"{failures} failed health checks")
            if self._launched:
                await self._restart()
                return 0
        return failures

    async def _restart(self) -> None:
        if not self._launched or self._closed or self._relaunching():
            # a relaunch under way (a planned one, e.g. vLLM's weight update) or just done:
            # its stopped process was not a crash and must not spend the restart budget
            return
        if self._restarts >= self.options.max_restarts:
            if self._restarts == self.options.max_restarts:
                self._restarts += 1  # log once
                log.error("engine_restart_exhausted", engine=self.name,
                          restarts=self.options.max_restarts)
            return
        self._restarts += 1
        await asyncio.sleep(min(2.0 ** (self._restarts - 1), 30.0))
        if self._relaunching():
            self._restarts -= 1  # relaunched meanwhile by someone else: no restart spent
            return
        log.info("engine_restart", engine=self.name, attempt=self._restarts)
        try:
            await self.relaunch()
        except EngineError as e:
            log.error("engine_restart_failed", engine=self.name, error=str(e))
            self._probe_now.set()  # try again on the next round

    def _relaunching(self) -> bool:
        """A relaunch holds the lock, or one finished since the crash was seen (the server is
        up on a live process)."""
        return self._relaunch_lock.locked() or (
            self._up and self._proc is not None and self._proc.running)

    async def relaunch(self, reason: str = "") -> None:
        """Stop a launched server and start it again from the latest disk weights; the engine
        is down meanwhile (its streams raise `EngineUnavailable`) and up when healthy."""
        if not self._launched:
            raise EngineError(f"{self.name} was not launched by asyncrl; cannot relaunch it")
        async with self._relaunch_lock:
            if self._up and self._proc is not None and self._proc.running and not reason:
                return  # someone else relaunched it while we waited
            if reason:
                self.mark_down(reason)
            await self._stop_process()
            await self._launch()
            await self._wait_ready()
            await self._on_ready()
            self.policy_version = self._weights[1] if self._weights else 0
            self._mark_up()

    async def _recover(self) -> None:
        """A server answers again after being down. It may have been restarted by someone
        else, so re-read it and re-load the latest disk weights (idempotent); its version is
        then that of those weights (tensor updates since are lost with a restart)."""
        try:
            await self._on_ready()
            async with self._update_lock:
                path, version = self._weights or ("", 0)
                if version != 0:
                    await self._update_locked(WeightUpdate(version=version, path=path))
                self.policy_version = version
        except (EngineError, WeightSyncError) as e:
            log.warning("engine_recover_failed", engine=self.name, error=str(e))
            return
        self._mark_up()

    # --------------------------------------------------------------------------- calls
    async def call(self, method: str, path: str, *, json: Any = None,
                   params: dict[str, str] | None = None, timeout_s: float | None = None,
                   retries: int = 0) -> tuple[int, bytes]:
        """One control call with a deadline; retried on connection errors and timeouts only."""
        return await remote_http.control_call(
            self._session, self.url, method, path, name=self.name, json=json, params=params,
            timeout_s=timeout_s or self.options.control_timeout_s, retries=retries)

    async def call_json(self, method: str, path: str, **kw: Any) -> Any:
        status, body = await self.call(method, path, **kw)
        return remote_http.json_reply(self.name, method, path, status, body)

    # -------------------------------------------------------------------------- stream
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.stream_via(self.url, request)

    async def stream_via(self, base_url: str, request: GenerateRequest,
                         streams: StreamGuard | None = None) -> AsyncIterator[TokenDelta]:
        """Stream `request` from `base_url` (this server, or a router in front of it).

        Every network wait has a deadline (`request_timeout_s` for the whole request); while
        the consumer holds a delta no timer runs. An abort or a down server cuts the wait at
        once. The connection is closed (the server drops the request) unless the stream ran
        to `[DONE]`. The reading itself is `remote_stream.StreamGuard.stream`, of `streams`
        when given (a router's own: the router picks the server, so this one going down
        must not cut the stream), else this server's.
        """
        if not self._up:
            raise EngineUnavailable(f"{self.name} is down: {self._down_reason}")
        guard = self._streams if streams is None else streams
        if guard.take_early_abort(request.request_id):
            yield finish_delta("abort", self.policy_version)  # aborted before it was sent
            return
        path, body = self._request(request)
        # aclosing: closing this stream closes the guard's at once (its connection with it)
        async with contextlib.aclosing(guard.stream(
                self._session, base_url + path, body, request,
                timeout_s=self._request_timeout_s, decode=self._decode)) as deltas:
            async for delta in deltas:
                yield delta

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort". Unknown ids are a no-op
        locally but still sent to the server (the request may not have been streamed yet)."""
        self._streams.note_abort(request_id)
        if self._up:
            try:
                await self._server_abort(request_id)
            except EngineError as e:
                log.warning("engine_abort_failed", engine=self.name, request_id=request_id,
                            error=str(e))
        self._streams.cut(request_id, "abort")

    # ---------------------------------------------------------------------------- load
    async def load(self) -> EngineLoad:
        """KV tokens in use and capacity, running and waiting requests (cached `load_ttl_s`)."""
        if not self._up:
            raise EngineUnavailable(f"{self.name} is down: {self._down_reason}")
        return await self._load.get()

    # ------------------------------------------------------------------------- weights
    async def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights: pause, apply, flush the prefix cache, resume; bump the version.

        A disk update sent while the server is down is remembered and loaded when it comes
        back (a relaunch starts from it). Raises `WeightSyncError`.
        """
        self._check_update(update)
        async with self._update_lock:
            if update.path:
                self._weights = (update.path, update.version)
            if not self._up:
                if update.path:
                    log.warning("engine_weights_deferred", engine=self.name,
                                version=update.version, reason=self._down_reason)
                    return
                raise WeightSyncError(f"{self.name} is down: {self._down_reason}")
            await self._update_locked(update)

    async def _update_locked(self, update: WeightUpdate) -> None:
        await self._run_update(update.version, update.adapter_path or update.path or
                               "<tensors>", lambda: self._apply(update))
        await self._after_update()

    def _check_update(self, update: WeightUpdate) -> None:
        """Hook: refuse (`WeightSyncError`) an update this server cannot take, before
        anything is sent or remembered."""

    async def _after_update(self) -> None:
        """Hook: work after an applied update, the server resumed and the lock still held
        (unloading stale LoRA adapters)."""

    async def _run_update(self, version: int, source: str,
                          apply: Callable[[], Awaitable[None]]) -> None:
        """The one update sequence every weight path goes through (the caller holds
        `_update_lock`): pause, `apply`, flush, bump the version, resume. The whole of it has
        the deadline `weight_timeout_s`; any failure is a `WeightSyncError` and the server is
        resumed either way (a failed resume takes the server out of service)."""
        log.info("engine_weights_update", engine=self.name, version=version, source=source)
        paused = False
        try:
            async with asyncio.timeout(self.options.weight_timeout_s):
                await self._pause()
                paused = True
                await apply()
                self.policy_version = version
                await self._flush()
        except WeightSyncError:
            raise
        except (EngineError, TimeoutError) as e:
            what = str(e) or f"no answer within {self.options.weight_timeout_s:.0f}s"
            raise WeightSyncError(f"{self.name}: weight update to version {version} "
                                  f"failed: {what}") from e
        finally:
            if paused:
                try:
                    await asyncio.shield(self._resume())
                except EngineError as e:
                    self.mark_down(f"resume after weight update failed: {e}")


class ServerEngine(RemoteEngine):
    """One server of a fleet built from an `[engine]` table (`cfg`): the `index`-th, named
    `{kind}-{index}`, holding the LoRA adapter slots every server kind keeps (`adapters`),
    its KV capacity and version once read. The SGLang and vLLM engines subclass it."""

    kind = "server"

    def __init__(self, cfg: Any, *, index: int, session: aiohttp.ClientSession | None = None,
                 url: str = "", model_path: str = "", port: int = 0,
                 options: RemoteOptions | None = None) -> None:
        super().__init__(name=f"{self.kind}-{index}", session=session, url=url, port=port,
                         model_path=model_path, request_timeout_s=cfg.request_timeout_s,
                         options=options)
        self.cfg = cfg
        self.index = index
        self.capacity = 0
        self.server_version = ""
        self.adapters = AdapterSlots(self.name)

    product = "this server"
    """The server's name in messages ("SGLang", "vLLM")."""

    def _check_update(self, update: WeightUpdate) -> None:
        if update.adapter is not None:
            raise WeightSyncError(f"{self.name}: {self.product} loads LoRA adapters from a "
                                  f"directory; set engine.weight_sync = \"disk\"")
        self.adapters.check(update)


@contextlib.asynccontextmanager
async def open_all(engines: Sequence[Any]) -> AsyncIterator[list[Any]]:
    """Start engines concurrently (`async with` each); close them all on exit or failure."""
    async with contextlib.AsyncExitStack() as stack:
        started = await asyncio.gather(*(stack.enter_async_context(e) for e in engines),
                                       return_exceptions=True)
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        yield list(engines)
