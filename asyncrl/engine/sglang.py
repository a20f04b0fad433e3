"""The `sglang` engine: SGLang servers behind the engine protocol.

Owns: SGLang's native HTTP wire format — the launch command, streaming `/generate` with input
ids, load from `/metrics` (or `/get_load`), abort, pause/flush/resume and the three weight
paths (disk, tensors when colocated, an NCCL group when disaggregated) — and the optional
sglang-router in front (`RoutedSGLangEngine`). The process, health, stream-guard and load-cache
machinery is `remote.RemoteEngine`; `open_sglang_engines` turns an `[engine]` table into
running engines. Does not own: scheduling, requeueing, or the trainer side of a weight sync.

Targeted server: SGLang 0.5.23 (`pip install "sglang>=0.5.23,<0.6"`), from its http_server.py
and io_struct.py; exercised here only against the fake in `tests/fakes/sglang_server.py` (no
GPU on the CI machines): the `gpu` test and `bench/sglang_engine.py` are the real checks.
Endpoints relied on:
  POST /generate                  {"rid", "input_ids", "stream": true, "return_logprob": true,
                                   "logprob_start_len": -1, "sampling_params": {
                                   "max_new_tokens", "temperature", "top_p", "stop",
                                   "stop_token_ids", "no_stop_trim": true,
                                   "skip_special_tokens": false[, "sampling_seed"]}}
                                  → SSE `data: {"output_ids", "meta_info": {"id",
                                   "finish_reason": null | {"type": "stop"|"length"|"abort"},
                                   "output_token_logprobs": [[logprob, id, null], ...],
                                   "completion_tokens"}}` … `data: [DONE]`
  POST /abort_request             {"rid"}
  GET  /get_server_info           "max_total_num_tokens", "dp_size", "version"
  GET  /metrics                   sglang:num_used_tokens, sglang:num_running_reqs,
                                  sglang:num_queue_reqs (launched with --enable-metrics)
  GET  /get_load                  fallback when metrics are off (attached servers)
  GET  /health                    liveness (a one-token generation when idle)
  POST /pause_generation          {"mode": "retract"}; POST /continue_generation
  POST /update_weights_from_disk  {"model_path", "weight_version", "abort_all_requests": false}
  POST /update_weights_from_tensor {"serialized_named_tensors": [one per TP rank],
                                   "load_format": null, "flush_cache", "weight_version"}
  POST /init_weights_update_group {"master_address", "master_port", "rank_offset",
                                   "world_size", "group_name", "backend"}
  POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
                                   "flush_cache", "weight_version"}
  POST /flush_cache
Launched with `python -m sglang.launch_server --model-path P --host H --port N --tp-size T
--base-gpu-id i*T --mem-fraction-static F --enable-metrics --incremental-streaming-output`.
Streams in both SGLang modes are read correctly (cumulative or incremental `output_ids` /
logprobs, told apart by `meta_info.completion_tokens`), so older attached servers work too.

Logprobs: SGLang returns log-softmax of the temperature-scaled logits before top-p filtering
(unless the server sets SGLANG_RETURN_ORIGINAL_LOGPROB), which is the protocol's contract.
Generation also stops at the model's own EOS (SGLang's `ignore_eos` would disable
`stop_token_ids` too), so callers should list EOS in `stop_token_ids` for every engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.engine.http_wire import gauge, parse_prometheus
from asyncrl.engine.remote import RemoteEngine, RemoteOptions, open_all, with_log_dir
from asyncrl.engine.server_process import pick_ports
from asyncrl.errors import ConfigError, EngineError, EngineUnavailable, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

TENSOR_BUCKET_BYTES = 512 << 20
"""Tensors are sent to `/update_weights_from_tensor` in buckets of about this size."""


def sampling_body(request: GenerateRequest) -> dict[str, Any]:
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
        "stop": list(s.stop_strings), "stop_token_ids": list(s.stop_token_ids),
        "no_stop_trim": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    return {"rid": request.request_id, "input_ids": list(request.input_ids), "stream": True,
            "return_logprob": True, "logprob_start_len": -1, "sampling_params": params}


def decode_event(event: dict[str, Any], state: dict[str, Any], name: str) -> TokenDelta | None:
    """One `/generate` SSE event → the tokens it adds. `state["n"]` counts tokens seen."""
    if "error" in event:
        err = event["error"]
        raise EngineError(f"{name}: {err.get('message', err) if isinstance(err, dict) else err}")
    meta = event.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError(f"{name}: stream event without output_token_logprobs")
    n = state["n"]
    total = meta.get("completion_tokens")
    # Cumulative streams repeat everything so far; incremental ones send only what is new.
    cumulative = len(entries) == total if isinstance(total, int) else not state.get("incr")
    new = entries[n:] if cumulative and n else entries
    if isinstance(total, int) and n + len(new) != total:
        raise EngineError(f"{name}: stream lost tokens ({n} + {len(new)} != {total})")
    state["n"] = n + len(new)
    finish = meta.get("finish_reason")
    reason = None
    if finish is not None:
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort" and not state.get("aborting"):
            message = finish.get("message", "") if isinstance(finish, dict) else ""
            raise EngineError(f"{name}: server aborted the request: {message}")
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind or "")
        if reason is None:
            raise EngineError(f"{name}: unknown finish reason {finish!r}")
    if not new and reason is None:
        return None
    return TokenDelta(token_ids=[int(e[1]) for e in new],
                      logprobs=[float(e[0]) if e[0] is not None else 0.0 for e in new],
                      finish_reason=reason)


def serialize_named_tensors(named: Sequence[tuple[str, Any]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)`: a ForkingPickler
    pickle in base64. CUDA tensors travel as IPC handles, so the server must share the GPU."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()


class SGLangEngine(RemoteEngine):
    """One SGLang server (one GPU group), launched or attached."""

    kind = "sglang"
    health_path = "/health"

    def __init__(self, cfg: SGLangEngineConfig, *, index: int,
                 session: aiohttp.ClientSession | None = None, url: str = "", model_path: str = "", port: int = 0,
                 options: RemoteOptions | None = None) -> None:
        super().__init__(name=f"sglang-{index}", session=session, url=url, port=port,
                         model_path=model_path, request_timeout_s=cfg.request_timeout_s,
                         options=options)
        self.cfg = cfg
        self.index = index
        self.capacity = 0
        self.server_version = ""
        self._incremental = False
        self._can_pause = True
        self._page_size = 1

    # ---------------------------------------------------------------------- launching
    def _argv(self, model_path: str) -> list[str]:
        return [*self._launch_prefix("sglang.launch_server"),
                "--model-path", model_path, "--host", self.options.host,
                "--port", str(self.port), "--tp-size", str(self.cfg.tp_size),
                "--base-gpu-id", str(self.index * self.cfg.tp_size),
                "--mem-fraction-static", str(self.cfg.mem_fraction_static),
                "--enable-metrics", "--incremental-streaming-output", *self.cfg.extra_args]

    async def _on_ready(self) -> None:
        info = await self.call_json("GET", "/get_server_info", retries=2)
        per_rank = info.get("max_total_num_tokens")
        if not isinstance(per_rank, int):
            states = info.get("internal_states") or [{}]
            per_rank = states[0].get("max_total_num_tokens")
        if not isinstance(per_rank, int) or per_rank <= 0:
            raise EngineError(f"{self.name}: /get_server_info has no max_total_num_tokens")
        self.capacity = per_rank * int(info.get("dp_size") or 1)
        self._incremental = bool(info.get("incremental_streaming_output",
                                          info.get("stream_output", False)))
        self._page_size = int(info.get("page_size") or 1)
        self.server_version = str(info.get("version", ""))
        log.info("sglang_server_info", engine=self.name, version=self.server_version,
                 kv_capacity=self.capacity, incremental=self._incremental)

    # -------------------------------------------------------------------------- stream
    def _request(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        return "/generate", sampling_body(request)

    def _decode(self, event: dict[str, Any], state: dict[str, Any]) -> TokenDelta | None:
        state["incr"] = self._incremental
        state["aborting"] = state["request"].request_id in self._aborted
        return decode_event(event, state, self.name)

    async def _server_abort(self, request_id: str) -> None:
        status, body = await self.call("POST", "/abort_request", json={"rid": request_id},
                                       retries=1)
        if status != 200:
            raise EngineError(f"{self.name}: abort -> HTTP {status}: {body[:200]!r}")

    # ---------------------------------------------------------------------------- load
    async def _fetch_load(self) -> EngineLoad:
        status, body = await self.call("GET", "/metrics", retries=1)
        if status == 200:
            m = parse_prometheus(body.decode(errors="replace"))
            used = gauge(m, "sglang:num_used_tokens", per="dp_rank")
            if used is not None:
                cap = gauge(m, "sglang:max_total_num_tokens", per="dp_rank")
                return EngineLoad(
                    kv_tokens_used=int(used),
                    kv_tokens_capacity=int(cap) if cap else self.capacity,
                    running=int(gauge(m, "sglang:num_running_reqs", per="dp_rank") or 0),
                    waiting=int(gauge(m, "sglang:num_queue_reqs", per="dp_rank") or 0))
        return self._parse_get_load(await self.call_json("GET", "/get_load", retries=1))

    def _parse_get_load(self, data: Any) -> EngineLoad:
        """`/get_load` across versions: `{"load": tokens}` or one dict per DP rank."""
        if isinstance(data, dict) and "load" in data and not isinstance(data["load"], list):
            return EngineLoad(kv_tokens_used=int(data["load"]),
                              kv_tokens_capacity=self.capacity, running=0, waiting=0)
        ranks = data.get("load", data) if isinstance(data, dict) else data
        if not isinstance(ranks, list):
            raise EngineError(f"{self.name}: unrecognised /get_load reply: {str(data)[:200]}")
        used = running = waiting = 0
        for r in ranks:
            tokens = r.get("num_tokens")
            if tokens is None:
                tokens = int(r.get("num_pages", 0)) * self._page_size
            used += int(tokens)
            w = int(r.get("num_waiting_reqs", 0))
            waiting += w
            running += max(0, int(r.get("num_reqs", 0)) - w)
        return EngineLoad(kv_tokens_used=used, kv_tokens_capacity=self.capacity,
                          running=running, waiting=waiting)

    # ------------------------------------------------------------------------- weights
    async def _pause(self) -> None:
        if not self._can_pause:
            return
        # "retract": running requests go back to the queue, their KV is recomputed with the
        # new weights after /continue_generation; nothing is aborted.
        status, _ = await self.call("POST", "/pause_generation", json={"mode": "retract"})
        if status == 404:
            self._can_pause = False  # older server: updates drain in-flight requests instead
        elif status != 200:
            raise EngineError(f"{self.name}: pause_generation -> HTTP {status}")

    async def _resume(self) -> None:
        if self._can_pause:
            await self.call_json("POST", "/continue_generation", json={})

    async def _flush(self) -> None:
        status, body = await self.call("POST", "/flush_cache")
        if status != 200:  # SGLang refuses while requests run; the update flushed already
            log.warning("sglang_flush_refused", engine=self.name, status=status,
                        body=body[:200].decode(errors="replace"))

    async def _apply(self, update: WeightUpdate) -> None:
        if update.path:
            await self._expect_success("/update_weights_from_disk", {
                "model_path": update.path, "weight_version": str(update.version),
                "abort_all_requests": False}, timeout_s=self.options.weight_timeout_s)
        elif update.state_dict is not None:
            await self._send_tensors(update)
        else:
            raise WeightSyncError(f"{self.name}: a weight update needs a path or tensors")

    async def _send_tensors(self, update: WeightUpdate) -> None:
        """Colocated sync: tensors go as CUDA IPC handles in size-bounded buckets; the last
        bucket flushes the cache and sets the version."""
        items = list(dict(update.state_dict).items())  # type: ignore[call-overload]
        buckets: list[list[tuple[str, Any]]] = [[]]
        size = 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and size + nbytes > TENSOR_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t.detach().contiguous()))
            size += nbytes
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            payload = serialize_named_tensors(bucket)
            body: dict[str, Any] = {"serialized_named_tensors": [payload] * self.cfg.tp_size,
                                    "load_format": None, "flush_cache": last}
            if last:
                body["weight_version"] = str(update.version)
            await self._expect_success("/update_weights_from_tensor", body,
                                       timeout_s=self.options.weight_timeout_s)

    async def _expect_success(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        status, raw = await self.call("POST", path, json=body, timeout_s=timeout_s)
        text = raw[:500].decode(errors="replace")
        if status != 200 or '"success":false' in text.replace(" ", ""):
            raise EngineError(f"{self.name}: {path} -> HTTP {status}: {text}")
        return text

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "asyncrl", backend: str = "nccl",
                                        join: Callable[[], Awaitable[None]] | None = None
                                        ) -> None:
        """Disaggregated sync, step 1: the server's TP ranks join an NCCL group with the
        trainer (trainer rank 0, server ranks from `rank_offset`). `join` is the trainer's
        own rendezvous, run concurrently because both sides block until all ranks arrive."""
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size,
                "group_name": group_name, "backend": backend}
        await self._with_peer(self._expect_success("/init_weights_update_group", body,
                                                   timeout_s=self.options.weight_timeout_s), join)

    async def update_weights_from_distributed(
            self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
            broadcast: Callable[[], Awaitable[None]], group_name: str = "asyncrl") -> None:
        """Disaggregated sync, step 2: pause, receive the tensors the trainer `broadcast`s
        (rank 0 of the group) while the server posts its receive, flush, resume."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": True, "weight_version": str(version)}
        async with self._update_lock:
            if not self.healthy:
                raise WeightSyncError(f"{self.name} is down")
            try:
                await self._pause()
                try:
                    await self._with_peer(self._expect_success(
                        "/update_weights_from_distributed", body,
                        timeout_s=self.options.weight_timeout_s), broadcast)
                    self.policy_version = version
                    await self._flush()
                finally:
                    await asyncio.shield(self._resume())
            except (EngineError, TimeoutError) as e:
                raise WeightSyncError(f"{self.name}: NCCL update to {version} failed: {e}") from e

    @staticmethod
    async def _with_peer(server_call: Awaitable[Any],
                         peer: Callable[[], Awaitable[None]] | None) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server_call)  # type: ignore[arg-type]
            if peer is not None:
                tg.create_task(peer())  # type: ignore[arg-type]


class RoutedSGLangEngine:
    """SGLang servers behind an sglang-router: one engine to the scheduler.

    Generation goes through the router (it keeps prefix-cache affinity across servers); load
    is the sum over servers; abort and weight updates go to every server. Down while no
    server is up. Servers asyncrl launched are registered with the router on start.
    """

    kind = "sglang"

    def __init__(self, router_url: str, servers: Sequence[SGLangEngine], *,
                 register: bool = False) -> None:
        self.name = "sglang-router"
        self.router_url = router_url.rstrip("/")
        self.servers = list(servers)
        self._register = register
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def policy_version(self) -> int:
        return min(s.policy_version for s in self.servers)

    @property
    def healthy(self) -> bool:
        return any(s.healthy for s in self.servers)

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
                    await _register_with_router(s, self.router_url)
        except BaseException:
            await asyncio.shield(stack.aclose())
            raise
        self._stack = stack

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await asyncio.shield(stack.aclose())

    def _any(self) -> SGLangEngine:
        for s in self.servers:
            if s.healthy:
                return s
        raise EngineUnavailable("no SGLang server behind the router is up")

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self._any().stream_via(self.router_url, request)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(s.abort(request_id) for s in self.servers if s.healthy))

    async def load(self) -> EngineLoad:
        loads = []
        for s in self.servers:
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
                          waiting=sum(x.waiting for x in loads))

    async def update_weights(self, update: WeightUpdate) -> None:
        async with asyncio.TaskGroup() as tg:
            for s in self.servers:
                tg.create_task(s.update_weights(update))


async def _register_with_router(server: SGLangEngine, router_url: str) -> None:
    """sglang-router learns a launched worker through `POST /add_worker?url=...`."""
    try:
        async with asyncio.timeout(server.options.control_timeout_s):
            async with server.session.post(f"{router_url}/add_worker",
                                           params={"url": server.url}) as resp:
                if resp.status != 200:
                    raise EngineError(f"router refused {server.url}: HTTP {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise EngineUnavailable(f"sglang-router at {router_url} unreachable: {e}") from e


def build_sglang_engines(cfg: SGLangEngineConfig, *, model: Any = None, tokenizer: Any = None,
                         model_path: str = "", run_dir: str | Path | None = None,
                         session: aiohttp.ClientSession | None = None,
                         remote_options: RemoteOptions | None = None,
                         **_ignored: Any) -> list[Any]:
    """The registry's builder: engines for `[engine] kind = "sglang"`, not yet started.

    Attaches to `cfg.urls`, or launches `cfg.num_servers` servers loading `model_path` (an
    HF directory; the caller saves a model built from `model.init` first) with logs under
    `run_dir/engines`. With `cfg.router_url`, one `RoutedSGLangEngine` over all servers.
    `model`/`tokenizer` are for in-process kinds and ignored here.
    """
    options = with_log_dir(remote_options, run_dir)
    if cfg.urls:
        servers = [SGLangEngine(cfg, index=i, session=session, url=u, model_path=model_path,
                                options=options) for i, u in enumerate(cfg.urls)]
    else:
        if not model_path:
            raise ConfigError("model.path", "launching SGLang servers needs a model directory")
        ports = pick_ports(options.host, cfg.base_port, cfg.num_servers)
        servers = [SGLangEngine(cfg, index=i, session=session, port=p, model_path=model_path,
                                options=options) for i, p in enumerate(ports)]
    if cfg.router_url:
        return [RoutedSGLangEngine(cfg.router_url, servers, register=not cfg.urls)]
    return servers


@contextlib.asynccontextmanager
async def open_sglang_engines(cfg: SGLangEngineConfig, **kw: Any) -> AsyncIterator[list[Any]]:
    """`build_sglang_engines(cfg, **kw)`, started; stopped on exit."""
    async with open_all(build_sglang_engines(cfg, **kw)) as engines:
        yield engines
