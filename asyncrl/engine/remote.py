"""Shared machinery of engines backed by inference servers over HTTP (SGLang, vLLM).

Owns: launching a server as a child process (its own process group, logs to a file, killed
with its process group on close and sent SIGTERM by the kernel if the orchestrator dies) or
attaching to one by URL; waiting for health; supervising it (a server that exits or fails its
health checks is marked down, every stream on it is cut with `EngineUnavailable`, and a server
asyncrl launched is relaunched with the latest weights; while a weight update is in progress a
server blocked loading weights may answer its health check late or with a 503, so only its
liveness is probed then (`update_liveness_path`), and the update has its own deadline,
`weight_timeout_s`); the stream guard (a deadline on every
network wait, local abort, SSE framing); the load cache (one scrape per `load_ttl_s`, shared by
concurrent callers); and the pause → apply → flush → resume sequence around weight updates.

Process handling is `server_process`, SSE and Prometheus parsing `http_wire`.

Does not own: any server's wire format (`sglang.py`, `vllm.py` subclass `RemoteEngine`), or
what happens to a rollout whose stream raised `EngineUnavailable` (the scheduler requeues it
from its last completed turn on another engine).

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
import msgspec
import orjson

from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.engine.http_wire import SSEDecoder
from asyncrl.engine.server_process import ServerProcess
from asyncrl.errors import EngineError, EngineOverloaded, EngineUnavailable, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

_EARLY_ABORTS_KEPT = 4096
"""Ids aborted before their stream started that are remembered (oldest forgotten first)."""

_TRANSIENT = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""Failures worth one more try on an idempotent call (and the signature of a sick server)."""


class RemoteOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Process-level knobs of remote engines that are not part of a curriculum.

    Defaults suit a real run; tests shorten the intervals.
    """

    python: str = ""
    """Interpreter that has the server installed ("" = this interpreter)."""
    launcher: tuple[str, ...] = ()
    """Replaces `[python, -m, <server module>]` in the launch command (wrappers, fakes)."""
    host: str = "127.0.0.1"
    """Interface launched servers listen on (and the host in their URL)."""
    log_dir: str = ""
    """Directory for server logs (the run directory's `engines/`); "" = a temp directory."""
    env: dict[str, str] = {}
    """Extra environment for launched servers."""
    startup_timeout_s: float = 900.0
    """A launched server that is not healthy by then is a failed launch."""
    health_interval_s: float = 5.0
    """Seconds between health probes of a server."""
    health_timeout_s: float = 30.0
    """Deadline of one probe (SGLang's `/health` generates a token and answers 503 after
    20 s without one, so this must exceed 20 s to see the 503 rather than a timeout)."""
    health_failures: int = 3
    """Consecutive failed probes before a server is marked down."""
    control_timeout_s: float = 30.0
    """Deadline of one control call (load scrape, abort, pause, flush)."""
    weight_timeout_s: float = 900.0
    """Deadline of one weight update, pause and resume included."""
    load_ttl_s: float = 0.25
    """A load scrape is reused for this long."""
    max_restarts: int = 5
    """Relaunches of one server before it stays down."""
    stop_grace_s: float = 20.0
    """SIGTERM → SIGKILL grace when stopping a launched server."""


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


class _StreamCtl:
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
        self._streams: dict[str, _StreamCtl] = {}
        self._aborted: set[str] = set()
        self._early_aborts: dict[str, None] = {}
        """Ids aborted before their stream started (bounded, oldest dropped): such a stream
        ends at once with "abort" instead of running to the end."""
        self._load = LoadCache(self.options.load_ttl_s)
        self._load_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._relaunch_lock = asyncio.Lock()
        self._probe_now = asyncio.Event()
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
        for ctl in list(self._streams.values()):
            ctl.cut("down")
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
        try:
            async with asyncio.timeout(timeout_s or self.options.health_timeout_s):
                async with self._session.get(self.url + (path or self.health_path)) as resp:
                    await resp.read()
                    return resp.status == 200
        except _TRANSIENT:
            return False

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

    def mark_down(self, reason: str) -> None:
        """Take the server out of service: cut its streams (they raise EngineUnavailable)."""
        if not self._up:
            return
        self._up, self._down_reason = False, reason
        self._load.clear()
        for ctl in list(self._streams.values()):
            ctl.cut("down")
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
        timeout_s = timeout_s or self.options.control_timeout_s
        for attempt in range(retries + 1):
            try:
                async with asyncio.timeout(timeout_s):
                    async with self._session.request(method, self.url + path, json=json,
                                                     params=params) as resp:
                        return resp.status, await resp.read()
            except _TRANSIENT as e:
                if attempt == retries:
                    raise EngineUnavailable(
                        f"{self.name}: {method} {path} failed: {type(e).__name__}: {e}") from e
                await asyncio.sleep(min(0.25 * 2 ** attempt, 2.0))
        raise AssertionError("unreachable")

    async def call_json(self, method: str, path: str, **kw: Any) -> Any:
        status, body = await self.call(method, path, **kw)
        if status != 200:
            raise EngineError(f"{self.name}: {method} {path} -> HTTP {status}: "
                              f"{body[:300].decode(errors='replace')}")
        try:
            return orjson.loads(body) if body else None
        except orjson.JSONDecodeError as e:
            raise EngineError(f"{self.name}: {path} returned non-JSON: {body[:200]!r}") from e

    # -------------------------------------------------------------------------- stream
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.stream_via(self.url, request)

    async def stream_via(self, base_url: str, request: GenerateRequest
                         ) -> AsyncIterator[TokenDelta]:
        """Stream `request` from `base_url` (this server, or a router in front of it).

        Every network wait has a deadline (`request_timeout_s` for the whole request); while
        the consumer holds a delta no timer runs. An abort or a down server cuts the wait at
        once. The connection is closed (the server drops the request) unless the stream ran
        to `[DONE]`.
        """
        if not self._up:
            raise EngineUnavailable(f"{self.name} is down: {self._down_reason}")
        if request.request_id in self._early_aborts:
            del self._early_aborts[request.request_id]
            yield finish_delta("abort", self.policy_version)  # aborted before it was sent
            return
        path, body = self._request(request)
        ctl = _StreamCtl(request.request_id)
        self._streams[request.request_id] = ctl
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout_s
        decoder, state = SSEDecoder(), {"n": 0, "request": request, "done": False}
        resp: aiohttp.ClientResponse | None = None
        final: TokenDelta | None = None
        try:
            try:
                # `ctl.timeout` is set only while its block runs: a stream failing out of the
                # block (connection refused) marks the server down, which cuts every stream
                try:
                    async with asyncio.timeout_at(deadline) as ctl.timeout:
                        resp = await self._session.post(base_url + path, json=body)
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
                        delta = self._decode(orjson.loads(data), state)
                        if delta is None or final is not None:
                            continue
                        # the server's own tag of these tokens when it gives one (tokens
                        # made before an update but read after it keep the old version)
                        v = state["version"]
                        delta.policy_version = v if isinstance(v, int) else self.policy_version
                        if delta.finish_reason is not None:
                            final = delta
                        else:
                            yield delta
            except TimeoutError:
                if ctl.cut_reason is None and final is None:
                    self._probe_now.set()
                    raise EngineUnavailable(f"{self.name}: request {request.request_id} "
                                            f"exceeded {self._request_timeout_s:.0f}s") from None
            except aiohttp.ClientConnectorError as e:
                self.mark_down(f"connection refused: {e}")
                raise EngineUnavailable(f"{self.name} unreachable: {e}") from e
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                if ctl.cut_reason is None and final is None:
                    self._probe_now.set()
                    raise EngineUnavailable(
                        f"{self.name}: stream {request.request_id} broke: {e!r}") from e
            except orjson.JSONDecodeError as e:
                raise EngineError(f"{self.name}: malformed stream event: {e}") from e
            if final is not None:
                yield final
            elif ctl.cut_reason == "abort" or request.request_id in self._aborted:
                yield finish_delta("abort", self.policy_version)
            elif ctl.cut_reason == "down":
                raise EngineUnavailable(f"{self.name} went down: {self._down_reason}")
            else:
                self._probe_now.set()
                raise EngineUnavailable(f"{self.name}: stream {request.request_id} ended "
                                        "without a finish reason")
        finally:
            self._streams.pop(request.request_id, None)
            self._aborted.discard(request.request_id)
            if resp is not None:
                if state["done"]:
                    resp.release()
                else:
                    resp.close()

    def _http_error(self, status: int, body: bytes) -> EngineError:
        text = body[:500].decode(errors="replace")
        if status == 429:
            return EngineOverloaded(f"{self.name}: HTTP 429: {text}")
        if status >= 500:
            self._probe_now.set()
            return EngineUnavailable(f"{self.name}: HTTP {status}: {text}")
        return EngineError(f"{self.name}: HTTP {status}: {text}")

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort". Unknown ids are a no-op
        locally but still sent to the server (the request may not have been streamed yet)."""
        ctl = self._streams.get(request_id)
        if ctl is not None:
            self._aborted.add(request_id)
        else:
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS_KEPT:
                del self._early_aborts[next(iter(self._early_aborts))]
        if self._up:
            try:
                await self._server_abort(request_id)
            except EngineError as e:
                log.warning("engine_abort_failed", engine=self.name, request_id=request_id,
                            error=str(e))
        ctl = self._streams.get(request_id)
        if ctl is not None:
            ctl.cut("abort")

    # ---------------------------------------------------------------------------- load
    async def load(self) -> EngineLoad:
        """KV tokens in use and capacity, running and waiting requests (cached `load_ttl_s`)."""
        if not self._up:
            raise EngineUnavailable(f"{self.name} is down: {self._down_reason}")
        loop = asyncio.get_running_loop()
        if self._load.fresh(loop.time()):
            return self._load.aged(loop.time())
        async with self._load_lock:
            if self._load.fresh(loop.time()):
                return self._load.aged(loop.time())
            try:
                value = await self._fetch_load()
            except EngineUnavailable:
                self._probe_now.set()
                if self._load.value is not None:  # one failed scrape: last value, probe now
                    return self._load.aged(loop.time())
                raise
            self._load.put(value, loop.time())
            return value

    # ------------------------------------------------------------------------- weights
    async def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights: pause, apply, flush the prefix cache, resume; bump the version.

        A disk update sent while the server is down is remembered and loaded when it comes
        back (a relaunch starts from it). Raises `WeightSyncError`.
        """
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
        await self._run_update(update.version, update.path or "<tensors>",
                               lambda: self._apply(update))

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


def with_log_dir(options: RemoteOptions | None, run_dir: str | Path | None) -> RemoteOptions:
    """`options` with server logs under `run_dir/engines` unless a log dir is set already."""
    options = options or RemoteOptions()
    if run_dir and not options.log_dir:
        options = msgspec.structs.replace(options, log_dir=str(Path(run_dir) / "engines"))
    return options
