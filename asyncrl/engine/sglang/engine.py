"""The `sglang` engine: SGLang servers behind the engine protocol.

Owns: SGLang's native HTTP wire format: the launch command, streaming `/generate` with input
ids, load from `/v1/loads`, abort, pause/resume, and the three weight paths (disk, tensors when
colocated, an NCCL group when disaggregated), whose protocol (sessions, payloads, reply checks)
is `sglang_weights`. The process, health, stream-guard, load-cache and update-sequence
machinery is `remote.RemoteEngine`. Does not own: the sglang-router in front
(`sglang_router.RoutedSGLangEngine`), turning an `[engine]` table into engines
(`sglang_fleet`, which imports this module, never the reverse), scheduling, requeueing, or
the trainer side of a weight sync (`weights.with_peer` runs it alongside the server's
call).

Targeted server: SGLang 0.5.23 (`pip install "sglang>=0.5.23,<0.6"`), read from the released
wheel (`../../docs/recipe.md` lists what was checked). Unit tests run against the fake in
`tests/fakes/sglang_server.py`; `tests/engine/test_sglang_contract.py` holds the same assertions
against a real server when one is installed (`gpu`). Endpoints relied on:
  POST /generate                  {"rid", "input_ids", "stream": true, "return_logprob": true,
                                   "logprob_start_len": -1, "sampling_params": {
                                   "max_new_tokens", "temperature", "top_p", "stop",
                                   "stop_token_ids", "no_stop_trim": true,
                                   "skip_special_tokens": false,
                                   "spaces_between_special_tokens": false[, "sampling_seed"]}}
                                  → SSE `data: {"output_ids", "meta_info": {"id",
                                   "finish_reason": null | {"type": "stop"|"length"|"abort"},
                                   "output_token_logprobs": [[logprob, id, null], ...],
                                   "completion_tokens", "weight_version"}}` … `data: [DONE]`;
                                   with routing replay the body adds "return_routed_experts":
                                   true (server launched with --enable-return-routed-experts)
                                   and the last event's meta_info "routed_experts": base64 of
                                   int32 [prompt + completion - 1, layers, top_k] (docs/moe.md)
                                   unknown sampling keys are a 400 `{"error": str}`
  POST /abort_request             {"rid"} (the scheduler matches rids by prefix, so every rid
                                   sent ends in a terminator, see `wire_rid`)
  GET  /server_info               "max_total_num_tokens" (per DP rank), "dp_size",
                                   "attn_dp_size", "incremental_streaming_output", "version";
                                   `/get_server_info` (deprecated alias) on a 404
  GET  /v1/loads?include=core     {"loads": [{"timestamp", "num_used_tokens",
                                   "num_total_tokens", "max_total_num_tokens",
                                   "num_running_reqs", "num_waiting_reqs"}, ...]} per DP rank
  GET  /health                    liveness: a one-token generation; 503 while starting, and
                                   after 20 s without a token (paused, loading weights)
  GET  /model_info                liveness while a weight update runs ("weight_version")
  POST /pause_generation          {"mode": "retract"}; POST /continue_generation {}
  POST /update_weights_from_disk  {"model_path", "weight_version", "flush_cache": true,
                                   "abort_all_requests": false}
  POST /begin_weight_update       {"selector": "all"}; POST /end_weight_update {}
  POST /update_weights_from_tensor {"serialized_named_tensors": [one per TP rank],
                                   "load_format": null, "flush_cache", "weight_version"}
  POST /init_weights_update_group {"master_address", "master_port", "rank_offset",
                                   "world_size", "group_name", "backend"}
  POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
                                   "flush_cache", "weight_version"}: one call per bucket
                                   (the last flushes and sets the version)
  POST /destroy_weights_update_group {"group_name"}
  POST /load_lora_adapter         {"lora_name", "lora_path"} → {"success", "error_message",
                                   "loaded_adapters"}; POST /unload_lora_adapter {"lora_name"}
                                   (SGLang's dynamic LoRA API; the server must run with
                                   `--enable-lora --max-lora-rank R --lora-target-modules …`,
                                   `engine.extra_args`); a LoRA request names its adapter in
                                   `/generate`'s "lora_path"
Launched with `python -m sglang.launch_server --model-path P --host H --port N --tp-size T
--base-gpu-id i*T --mem-fraction-static F --enable-metrics --incremental-streaming-output`.
LoRA (a trainer with `trainer.lora`): each update loads the adapter directory it carries under
the name `asyncrl-v{version}` (after the base from disk when the update carries one), and every
request sent afterwards names it; tokens are tagged with the version of the adapter their
request was sent with (loading an adapter leaves SGLang's `weight_version` alone). SGLang's
unload waits for the requests that use the adapter, so the previous adapter stays loaded and
older ones are unloaded after the server has resumed.
Streams in both SGLang modes are read correctly (cumulative or incremental `output_ids` /
logprobs, told apart by `meta_info.completion_tokens`).

Logprobs: SGLang returns log-softmax of the temperature-scaled logits before top-p filtering
unless the server sets SGLANG_RETURN_ORIGINAL_LOGPROB (removed from a launched server's
environment). A `null` logprob (a non-finite value on the server) is an `EngineError`, never
read as 0. Generation also stops at the model's own EOS (SGLang's `ignore_eos` would disable
`stop_token_ids` too), so callers should list EOS in `stop_token_ids` for every engine.
`sampling_seed` is sent only to a server running `--enable-deterministic-inference`; any other
server ignores it (`sampling_batch_info.py:128,157-172`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.engine.remote.engine import ServerEngine
from asyncrl.engine.remote.options import RemoteOptions
from asyncrl.engine.sglang import weights
from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.log import get_logger
from asyncrl.records import RoutedExperts

log = get_logger(__name__)

__all__ = ["SGLangEngine", "decode_event", "parse_loads", "sampling_body", "wire_rid"]


def wire_rid(request_id: str) -> str:
    """The rid sent to SGLang for `request_id`. SGLang's scheduler aborts every request whose
    rid *starts with* the aborted one (`scheduler.py:5675-5812`), so each rid ends in "#" and
    has no other "#" ("%" and "#" are escaped): no rid sent is then a prefix of another."""
    return request_id.replace("%", "%25").replace("#", "%23") + "#"


def sampling_body(request: GenerateRequest, *, send_seed: bool = True) -> dict[str, Any]:
    s = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
        "stop": list(s.stop_strings), "stop_token_ids": list(s.stop_token_ids),
        "no_stop_trim": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if s.seed is not None and send_seed:
        params["sampling_seed"] = s.seed
    return {"rid": wire_rid(request.request_id), "input_ids": list(request.input_ids),
            "stream": True, "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": params}


def _version(tag: Any) -> int | None:
    """asyncrl's policy version from SGLang's `weight_version` tag ("default" → None)."""
    return int(tag) if isinstance(tag, str) and tag.isdigit() else None


def decode_event(event: dict[str, Any], state: dict[str, Any], name: str) -> TokenDelta | None:
    """One `/generate` SSE event → the tokens it adds. `state["n"]` counts tokens seen;
    `state["version"]` is set to the server's weight version of this chunk (None if untagged).
    An error frame, a malformed event or a `null` logprob is an `EngineError`."""
    if not isinstance(event, dict):
        raise EngineError(f"{name}: stream event is not an object: {str(event)[:200]}")
    if "error" in event:
        err = event["error"]
        raise EngineError(f"{name}: {err.get('message', err) if isinstance(err, dict) else err}")
    meta = event.get("meta_info")
    entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise EngineError(f"{name}: stream event without meta_info.output_token_logprobs: "
                          f"{str(event)[:200]}")
    n = state["n"]
    total = meta.get("completion_tokens")
    # Cumulative streams repeat everything so far; incremental ones send only what is new.
    cumulative = len(entries) == total if isinstance(total, int) else not state.get("incr")
    new = entries[n:] if cumulative and n else entries
    if isinstance(total, int) and n + len(new) != total:
        raise EngineError(f"{name}: stream lost tokens ({n} + {len(new)} != {total})")
    state["n"] = n + len(new)
    state["version"] = _version(meta.get("weight_version"))
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
    ids, lps = [], []
    for i, e in enumerate(new):
        if not isinstance(e, list | tuple) or len(e) < 2 or not isinstance(e[1], int):
            raise EngineError(f"{name}: malformed logprob entry {e!r}")
        if e[0] is None:  # orjson writes NaN and ±inf as null; 0.0 would mean probability 1
            raise EngineError(f"{name}: null (non-finite) logprob for token {e[1]} at output "
                              f"position {n + i}")
        ids.append(e[1])
        lps.append(float(e[0]))
    return TokenDelta(token_ids=ids, logprobs=lps, finish_reason=reason)


def routed_experts(meta: dict[str, Any], layers: int, top_k: int, name: str
                   ) -> RoutedExperts:
    """The last event's `meta_info.routed_experts` (base64 of little-endian int32
    `[prompt + completion - 1, layers, top_k]`) as a compact record."""
    import base64

    import numpy as np

    raw = meta.get("routed_experts")
    if not isinstance(raw, str):
        raise EngineError(f"{name}: no routed_experts in the answer (routing replay is on): "
                          "launch the server with --enable-return-routed-experts")
    try:
        arr = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<i4")
    except ValueError as e:
        raise EngineError(f"{name}: routed_experts is not base64 int32: {e}") from None
    if arr.size % (layers * top_k):
        raise EngineError(f"{name}: routed_experts has {arr.size} values, not a multiple of "
                          f"{layers} layers x top-{top_k}")
    if int(arr.min(initial=0)) < 0:  # 0.5.23 pads fused shared experts' columns with -1
        raise EngineError(f"{name}: routed_experts holds negative expert ids (shared experts "
                          "fused into the top-k): not supported, launch without that fusion")
    rows = arr.size // (layers * top_k)
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int) and \
            rows != prompt + completion - 1:
        raise EngineError(f"{name}: routed_experts has {rows} rows of {layers} layers x "
                          f"top-{top_k}, not prompt_tokens + completion_tokens - 1 = "
                          f"{prompt + completion - 1} (another top-k or layer count?)")
    small = int(arr.max(initial=0)) < 255
    data = arr.astype("<u1" if small else "<u2").tobytes()
    return RoutedExperts(layers=layers, top_k=top_k, itemsize=1 if small else 2, data=data)


def parse_loads(data: Any, name: str, fallback_capacity: int, now: float) -> EngineLoad:
    """`/v1/loads?include=core` → load summed over DP ranks. KV use counts queued prompts too
    (`num_total_tokens`); `age_s` is the age of the oldest rank's snapshot (`timestamp`, wall
    clock seconds)."""
    ranks = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        raise EngineError(f"{name}: unrecognised /v1/loads reply: {str(data)[:200]}")
    try:
        used = sum(int(r.get("num_total_tokens", r["num_used_tokens"])) for r in ranks)
        cap = sum(int(r.get("max_total_num_tokens") or 0) for r in ranks)
        running = sum(int(r.get("num_running_reqs", 0)) for r in ranks)
        waiting = sum(int(r.get("num_waiting_reqs", 0)) for r in ranks)
        stamps = [float(r["timestamp"]) for r in ranks if r.get("timestamp")]
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"{name}: unrecognised /v1/loads reply ({e!r}): {str(data)[:200]}") \
            from e
    age = max(0.0, now - min(stamps)) if stamps else 0.0
    return EngineLoad(kv_tokens_used=used, kv_tokens_capacity=cap or fallback_capacity,
                      running=running, waiting=waiting, age_s=age)


class SGLangEngine(ServerEngine):
    """One SGLang server (one GPU group), launched or attached."""

    kind = "sglang"
    product = "SGLang"
    health_path = "/health"
    update_liveness_path = "/model_info"  # answered by the HTTP front, scheduler busy or not
    env_unset = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)

    def __init__(self, cfg: SGLangEngineConfig, *, index: int,
                 session: aiohttp.ClientSession | None = None, url: str = "",
                 model_path: str = "", port: int = 0,
                 options: RemoteOptions | None = None) -> None:
        super().__init__(cfg, index=index, session=session, url=url, port=port,
                         model_path=model_path, options=options)
        self.cfg: SGLangEngineConfig = cfg
        self._incremental = False
        self._deterministic = False
        self._can_pause = True
        self._sessions = weights.SessionState()

    # ---------------------------------------------------------------------- launching
    def _argv(self, model_path: str) -> list[str]:
        return [*self._launch_prefix("sglang.launch_server"),
                "--model-path", model_path, "--host", self.options.host,
                "--port", str(self.port), "--tp-size", str(self.cfg.tp_size),
                "--base-gpu-id", str(self.index * self.cfg.tp_size),
                "--mem-fraction-static", str(self.cfg.mem_fraction_static),
                "--enable-metrics", "--incremental-streaming-output",
                *(["--enable-return-routed-experts"] if self.options.routed_experts else []),
                *self.cfg.extra_args]

    async def _on_ready(self) -> None:
        path = "/server_info"
        status, raw = await self.call("GET", path, retries=2)
        if status == 404:  # before 0.5.x's rename; a deprecated alias in 0.5.23
            path = "/get_server_info"
            status, raw = await self.call("GET", path, retries=2)
        if status != 200:
            raise EngineError(f"{self.name}: {path} -> HTTP {status}: "
                              f"{weights.server_message(raw)}")
        try:
            info = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise EngineError(f"{self.name}: {path} returned non-JSON: {raw[:200]!r}") from e
        if not isinstance(info, dict):
            raise EngineError(f"{self.name}: /server_info is not an object: {str(info)[:200]}")
        per_rank = info.get("max_total_num_tokens")
        if not isinstance(per_rank, int) or per_rank <= 0:
            raise EngineError(f"{self.name}: /server_info has no max_total_num_tokens")
        # one scheduler and KV pool per DP rank: dp_size * attn_dp_size (fields/parallel.py)
        ranks = int(info.get("dp_size") or 1) * int(info.get("attn_dp_size") or 1)
        self.capacity = per_rank * ranks
        self._incremental = bool(info.get("incremental_streaming_output", False))
        self._deterministic = bool(info.get("enable_deterministic_inference", False))
        self.server_version = str(info.get("version", ""))
        self.adapters.reset(self._weights[1] if self._weights else 0)
        log.info("sglang_server_info", engine=self.name, version=self.server_version,
                 kv_capacity=self.capacity, dp_ranks=ranks, incremental=self._incremental)

    # -------------------------------------------------------------------------- stream
    def _request(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        body = sampling_body(request, send_seed=self._deterministic)
        adapter = self.adapters.send(request.request_id)
        if adapter is not None:
            body["lora_path"] = adapter
        if self.options.routed_experts:
            body["return_routed_experts"] = True
        return "/generate", body

    def _decode(self, event: dict[str, Any], state: dict[str, Any]) -> TokenDelta | None:
        rid = state["request"].request_id
        state["incr"] = self._incremental
        delta = decode_event(event, state, self.name)
        self.adapters.stamp(rid, state, delta)
        if delta is not None and delta.finish_reason in ("stop", "length") and \
                self.options.routed_experts:
            layers, top_k = self.options.routed_experts[:2]
            delta.routed_experts = routed_experts(event["meta_info"], layers, top_k, self.name)
        return delta

    async def _server_abort(self, request_id: str) -> None:
        self.adapters.forget(request_id)
        status, body = await self.call("POST", "/abort_request",
                                       json={"rid": wire_rid(request_id)}, retries=1)
        if status != 200:
            raise EngineError(f"{self.name}: abort -> HTTP {status}: {body[:200]!r}")

    # ---------------------------------------------------------------------------- load
    async def _fetch_load(self) -> EngineLoad:
        data = await self.call_json("GET", "/v1/loads", params={"include": "core"}, retries=1)
        return parse_loads(data, self.name, self.capacity, time.time())

    # ------------------------------------------------------------------------- weights
    async def _pause(self) -> None:
        if not self._can_pause:
            return
        # "retract": running requests go back to the queue, their KV is recomputed with the
        # new weights after /continue_generation; nothing is aborted.
        status, raw = await self.call("POST", "/pause_generation", json={"mode": "retract"})
        if status == 404:
            self._can_pause = False  # older server: updates drain in-flight requests instead
        elif status != 200:
            raise WeightSyncError(f"{self.name}: /pause_generation -> HTTP {status}: "
                                  f"{weights.server_message(raw)}")

    async def _resume(self) -> None:
        if self._can_pause:
            await self.call_json("POST", "/continue_generation", json={})

    # The cache is flushed by the update call itself (`flush_cache: true`), which fails the
    # update when the flush is refused (`weight_updater.py:120-133`): no separate /flush_cache.

    async def _after_update(self) -> None:
        # after the resume, since SGLang's unload waits for the requests that use the adapter
        await self.adapters.unload_stale(self._unload_adapter)

    async def _load_adapter(self, name: str, path: str) -> None:
        await weights.post_update(self, "/load_lora_adapter", {
            "lora_name": name, "lora_path": path}, self.options.weight_timeout_s)

    async def _unload_adapter(self, name: str) -> None:
        await weights.post_update(self, "/unload_lora_adapter", {"lora_name": name},
                                  self.options.weight_timeout_s)

    async def _apply(self, update: WeightUpdate) -> None:
        if update.path or update.state_dict is not None:
            await self._apply_base(update)
            self.adapters.base_replaced(update.version)
        if update.adapter_path:
            await self.adapters.load(update, self._load_adapter, self._unload_adapter)
        elif not update.has_base:
            raise WeightSyncError(f"{self.name}: a weight update needs a path or tensors")

    async def _apply_base(self, update: WeightUpdate) -> None:
        timeout = self.options.weight_timeout_s
        if update.path:
            await weights.post_update(self, "/update_weights_from_disk", {
                "model_path": update.path, "weight_version": str(update.version),
                "flush_cache": True, "abort_all_requests": False}, timeout)
        elif update.state_dict is not None:
            items = list(dict(update.state_dict).items())  # type: ignore[call-overload]
            parts = weights.buckets(items, weights.TENSOR_BUCKET_BYTES)
            async with weights.weight_session(self, self._sessions):
                for i, bucket in enumerate(parts):
                    last = i == len(parts) - 1
                    body: dict[str, Any] = {
                        "serialized_named_tensors": weights.rank_payloads(bucket,
                                                                          self.cfg.tp_size),
                        "load_format": None, "flush_cache": last}
                    if last:  # the version changes once every bucket is in
                        body["weight_version"] = str(update.version)
                    await weights.post_update(self, "/update_weights_from_tensor", body,
                                              timeout)

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "asyncrl", backend: str = "nccl",
                                        join: Callable[[], Awaitable[None]] | None = None
                                        ) -> None:
        """Disaggregated sync, step 1: the server's TP ranks join a process group with the
        trainer (trainer rank 0, server ranks from `rank_offset`). `join` is the trainer's
        own rendezvous, run concurrently because both sides block until all ranks arrive
        (None when the caller runs it itself, as `weight_group` does for several servers).
        Raises `WeightSyncError`."""
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size,
                "group_name": group_name, "backend": backend}
        try:
            async with asyncio.timeout(self.options.weight_timeout_s):
                await weights.with_peer(weights.post_update(
                    self, "/init_weights_update_group", body, self.options.weight_timeout_s),
                    join)
        except (EngineError, TimeoutError) as e:
            what = str(e) or f"no answer within {self.options.weight_timeout_s:.0f}s"
            raise WeightSyncError(f"{self.name}: joining the weight-update group failed: "
                                  f"{what}") from e

    async def destroy_weights_update_group(self, group_name: str = "asyncrl") -> None:
        """The server leaves the group `group_name` (`/destroy_weights_update_group`; a server
        without the route, or that never joined, is left alone). Raises `WeightSyncError` or
        `EngineError` when the server refuses or does not answer."""
        status, raw = await self.call("POST", "/destroy_weights_update_group",
                                      json={"group_name": group_name})
        if status == 404:
            return
        message = weights.server_message(raw)
        if status != 200 and "does not exist" not in message:
            raise WeightSyncError(f"{self.name}: /destroy_weights_update_group -> HTTP "
                                  f"{status}: {message}")

    async def update_weights_from_distributed(
            self, *, version: int, broadcast: Callable[[], Awaitable[None]],
            names: list[str] | None = None, dtypes: list[str] | None = None,
            shapes: list[list[int]] | None = None,
            buckets: Sequence[weights.DistributedBucket] = (),
            group_name: str = "asyncrl") -> None:
        """Disaggregated sync, step 2: the server receives the tensors the trainer
        broadcasts (rank 0 of the group), inside a weight-update session and the same
        pause → load → resume sequence as every other path.

        The tensors come in `buckets` (or one bucket given as `names`, `dtypes`, `shapes`):
        one `/update_weights_from_distributed` call each, run together with one call of
        `broadcast` (the trainer's send of that bucket, so `broadcast` is called once per
        bucket, in order). Only the last call flushes the cache and sets the weight version.
        Raises `WeightSyncError` (the version stays the old one when any bucket failed)."""
        if not buckets:
            buckets = [weights.DistributedBucket(list(names or []), list(dtypes or []),
                                                 list(shapes or []))]
        bodies = []
        for i, b in enumerate(buckets):
            if not len(b.names) == len(b.dtypes) == len(b.shapes):
                raise WeightSyncError(f"{self.name}: names, dtypes and shapes differ in length")
            last = i == len(buckets) - 1
            body: dict[str, Any] = {"names": list(b.names),
                                    "dtypes": weights.torch_dtype_names(b.dtypes),
                                    "shapes": [list(s) for s in b.shapes],
                                    "group_name": group_name, "flush_cache": last}
            if last:  # the version changes once every bucket is in
                body["weight_version"] = str(version)
            bodies.append(body)
        timeout = self.options.weight_timeout_s

        async def apply() -> None:
            async with weights.weight_session(self, self._sessions):
                for body in bodies:
                    await weights.with_peer(weights.post_update(
                        self, "/update_weights_from_distributed", body, timeout), broadcast)

        async with self._update_lock:
            if not self.healthy:
                raise WeightSyncError(f"{self.name} is down: {self._down_reason}")
            await self._run_update(version, "nccl", apply)
