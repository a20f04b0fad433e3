"""Fake SGLang server: a real aiohttp app behaving like SGLang 0.5.23's native HTTP API.

Fakes the inference-server boundary for the `sglang` engine (and, through `FakeCore`, the
vLLM fake next to it). Written from the real server's source as
`docs/research/sglang-contract-audit.md` documents it (file:line references below are
wheel paths under `sglang/srt/`); it has only endpoints the real server has.

Behaviour modelled on the real server:
- `/generate`: unknown `sampling_params` keys are a 400 `{"error": "unknown field ..."}`
  (`api_types.py:177-207`); an input at or over the context length is an SSE error frame on
  HTTP 200; streams in incremental or cumulative mode; every chunk carries
  `meta_info.weight_version`, the last one `weight_versions` spans; aborts carry `status_code`
  and `err_type`; a request aborted while waiting gets the waiting-queue abort event
  (cumulative logprobs, `output_ids=[last]`, `tokenizer_manager.py:3577-3635`).
- Routed experts (`--enable-return-routed-experts`, routing replay): a request with
  `"return_routed_experts": true` gets on its last event `meta_info.routed_experts`, base64 of
  little-endian int32 `[prompt + completion - 1, layers, top_k]` (the shape of upstream
  SGLang's `routed_experts_capturer` and scheduler output; not in the repository's 0.5.23
  audit, see docs/moe.md), with made-up experts `routed_expert(position, layer, j)`;
  `routing_shape` (layers, top_k, experts) steers the shape. Without the flag the field is
  absent.
- `/abort_request`: prefix match on rids (`scheduler.py:5675-5812`); unknown rids dropped.
- `/pause_generation` modes `abort` (default), `retract` (running requests go back to the
  queue, their KV freed, and continue on the current weights after `/continue_generation`)
  and `in_place` (requests keep their KV); `/generate` calls sent while paused wait at the
  tokenizer, outside the scheduler's queue.
- `/health` (and `/health_generate`) generates: 503 while starting, 200 once the "scheduler"
  produces a token, 503 when it produces none within `health_check_timeout_s` (the real 20 s):
  so a paused server, or one busy loading weights, fails it.
- Weight updates: `/update_weights_from_tensor` and `/update_weights_from_distributed` need a
  `/begin_weight_update` session (400 `success: false` otherwise); a second begin is refused
  while one is open, an end without one too. Rank r of a `tp_size` server unpickles element r
  of `serialized_named_tensors`. `dtypes` must be torch attribute names. An update whose
  cache flush is refused (requests running or queued and not retracted) fails the update
  (`weight_updater.py:120-133`). Tensor payloads are opened as 0.5.23's
  `MultiprocessingSerializer.deserialize` opens them (`deserialize`: validated base64, torch's
  ForkingPickler rebuilds behind the allow-list unpickler), so across a process boundary a CPU
  tensor sent by file descriptor fails here as there. A disk update on an unpaused server waits for in-flight
  requests to finish. `weight_load_delay_s` makes every load block the scheduler that long.
- `/v1/loads?include=core`: one entry per DP rank with a wall-clock `timestamp`; the
  snapshot is republished when a request starts or ends and every 15 generated tokens, so it
  lags like the real one. `/metrics` gauges have no `max_total_num_tokens`.
- LoRA (`--enable-lora`, `--max-lora-rank`, `--lora-target-modules`, `--max-loaded-loras`;
  SGLang's documented dynamic LoRA API, docs/advanced_features/lora): `/load_lora_adapter`
  `{lora_name, lora_path}` answers `{success, error_message, loaded_adapters}` (400 with
  `success: false` for a server without LoRA, a name already loaded, a path that is no PEFT
  adapter directory, a rank over `--max-lora-rank`, or more than `--max-loaded-loras`);
  `/unload_lora_adapter` `{lora_name}` waits until no running request uses the adapter; a
  `/generate` body's `lora_path` (a loaded adapter's name) serves the request with that
  adapter (the scripted model's tokens then depend on the adapter's path too), an unknown
  name is a 400. Loading an adapter does not change `weight_version`.
- `/server_info` (and its deprecated alias `/get_server_info`), `/model_info`
  (`/get_model_info`), `/flush_cache` (refused while requests run or wait, unless retracted).

Simplifications (said here so no test leans on them): one process plays every TP and DP rank
(loads all sit on DP rank 0); tokens come from a scripted, deterministic "model" whose choices
depend on the loaded weights (no temperature, `sampling_seed` ignored as the real server does
without deterministic inference); a "decode iteration" is one generated token, and queued
incremental chunks are never merged into one; the weight endpoints do not assert `dp_size == 1`
as the real ones do; `/health` polls every `health_poll_s` (the real one every 1 s); the NCCL
path joins a real process group only for `backend = "gloo"` and a `tp_size` of 1 (what runs on
a CPU), built as the real one builds it; with "nccl" it receives nothing and takes a digest
of the request as its weights. `/destroy_weights_update_group` leaves a group.

Runs as a program taking SGLang's launch flags (`python tests/fakes/sglang_server.py
--model-path M --port 0 ...`), rejecting unknown ones as the real launcher does, and every
test runs it that way (`control.FakeProcess`), so what breaks at a process boundary breaks in
CI. Steered through the control routes under `/_fake/` (`fakes/control.py`):
- state: `calls` (bodies by path; tensor payloads recorded as their sizes), `loras`,
  `session_open`, `core.weights`, `core.weight_version`, `core.running`,
  `core.tokens_generated`;
- knobs: `incremental`, `starting` (/health answers 503), `dp_size`, `attn_dp_size`,
  `core.capacity`, `core.token_delay_s`, `core.model.script` (the i-th generated token),
  `core.vocab` (token id -> text, for stop strings);
- failures: `replies` {path: [status, body]} answers a path with a canned reply (a server
  error, an unexpected shape), `hang` stops answering (a wedged server), and
  `core.crash_after_tokens` / `--fake-crash-after-tokens` end the process mid-stream (a
  crashed one; a test may also kill the process, and start a new one on the same port).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import pickle
import struct
import sys
import time
import uuid
from typing import Any

from aiohttp import web

if not __package__:  # run as a program (a launched server): make `fakes` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakes.control import canned_reply, mount_control  # after the path set-up above
from fakes.scripted_core import (
    EOS,
    FakeCore,
    ScriptedModel,
    _Req,
    default_decode,
)

__all__ = ["EOS", "FakeCore", "FakeSGLang", "ScriptedModel", "_Req", "default_decode",
           "tensor_digest"]

LOADS_REFRESH_TOKENS = 15
"""`/v1/loads` is republished every this many generated tokens (SGLang: decode steps)."""

MAX_BODY_BYTES = 1 << 40
"""aiohttp's 1 MiB default would refuse what the real server takes (it sets no limit)."""

SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature",
                 "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf",
                 "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
                 "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
                 "choice")
"""SGLang 0.5.23's `SamplingParams` fields (`api/v1/api_types.py:1256`); others are a 400."""


def tensor_digest(named: list[tuple[str, Any]]) -> str:
    """The fake's weights after loading these (name, tensor) pairs: a digest of names and
    values, so a test can predict the outputs of exactly the tensors it sent."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return "tensors:" + h.hexdigest()


def _fail(message: str, status: int = 400, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=status)


def _ok(message: str = "Success", **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


class FakeSGLang:
    """The SGLang fake. Attributes of `core` (and the ones below) steer it."""

    def __init__(self, *, incremental: bool = True,
                 version: str = "0.5.23", tp_size: int = 1, dp_size: int = 1,
                 attn_dp_size: int = 1, context_length: int = 32768,
                 health_check_timeout_s: float = 20.0, health_poll_s: float = 0.05,
                 weight_load_delay_s: float = 0.0, enable_lora: bool = False,
                 max_lora_rank: int = 0, max_loaded_loras: int = 0,
                 return_routed_experts: bool = False, **core_kw: Any) -> None:
        self._init_kw = {"incremental": incremental, "version": version, "tp_size": tp_size,
                          "dp_size": dp_size, "attn_dp_size": attn_dp_size,
                          "context_length": context_length,
                          "health_check_timeout_s": health_check_timeout_s,
                          "health_poll_s": health_poll_s,
                          "weight_load_delay_s": weight_load_delay_s,
                          "enable_lora": enable_lora, "max_lora_rank": max_lora_rank,
                          "max_loaded_loras": max_loaded_loras,
                          "return_routed_experts": return_routed_experts, **core_kw}
        self.core = FakeCore(**core_kw)
        self.core.free_kv_on_pause = True
        self.core.on_change = self._on_change
        self.incremental = incremental
        self.version = version
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.attn_dp_size = attn_dp_size
        self.context_length = context_length
        self.health_check_timeout_s = health_check_timeout_s
        self.health_poll_s = health_poll_s
        self.weight_load_delay_s = weight_load_delay_s
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.max_loaded_loras = max_loaded_loras
        self.loras: dict[str, str] = {}
        """Loaded LoRA adapters: name -> path."""
        self.return_routed_experts = return_routed_experts
        self.routing_shape = [2, 2, 8]
        """Routed experts: [layers, top_k, experts] of the pretended MoE model."""
        self.starting = False
        self.pause_mode = ""
        self.session_open = False
        self.groups: dict[str, Any] = {}
        self.received: dict[str, Any] = {}
        """Tensors of the last tensor or gloo update, by name (rank 0's copy)."""
        self.replies: dict[str, tuple[int, Any]] = {}
        """Failure injection: path -> (status, body) answered instead of the real handler
        (a dict body as JSON, a str as text)."""
        self.url = ""
        self._snapshot: dict[str, Any] = {}
        self._last_snapshot_tokens = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._take_snapshot()

    @property
    def calls(self) -> dict[str, list[Any]]:
        return self.core.calls

    @property
    def ranks(self) -> int:
        return self.dp_size * self.attn_dp_size

    # ------------------------------------------------------------------------- serving
    def _reset(self) -> None:
        """The fake as launched (the control API's reset, between tests): same address."""
        kept = (self._runner, self._site, self.url)
        self.core.release()
        self.__init__(**self._init_kw)  # type: ignore[misc]
        self._runner, self._site, self.url = kept

    @web.middleware
    async def _injected(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/_fake/"):  # the test's control API answers always
            return await handler(request)
        await self.core.stall_if_hung()  # a wedged server answers nothing at all
        return await canned_reply(self, request) or await handler(request)

    def app(self) -> web.Application:
        # no body size limit, as uvicorn has none: a tensor update is one bucket per request
        app = web.Application(middlewares=[self._injected], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/load_lora_adapter", self.load_lora)
        r.add_post("/unload_lora_adapter", self.unload_lora)
        mount_control(app, self, self._reset)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        sock = self._site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    # ----------------------------------------------------------------------- generate
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls["/generate"].append(body)
        ids = body.get("input_ids")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            return web.json_response({"error": "invalid type: expected struct SamplingParams"},
                                     status=400)
        unknown = [k for k in sp if k not in SAMPLING_KEYS]
        if unknown:
            return web.json_response({"error": f"unknown field `{unknown[0]}`, expected one "
                                      f"of {', '.join(f'`{k}`' for k in SAMPLING_KEYS)}"},
                                     status=400)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return web.json_response({"error": "invalid type: expected a sequence of i64"},
                                     status=400)
        lora = body.get("lora_path")
        if lora is not None and lora not in self.loras:
            return web.json_response({"error": f"LoRA adapter {lora!r} is not loaded"
                                      if self.enable_lora else "LoRA is not enabled"},
                                     status=400)
        await self.core.unpaused.wait()  # requests sent during a pause wait at the tokenizer
        rid = body.get("rid") or uuid.uuid4().hex
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(ids) >= self.context_length:
            err = {"message": f"The input ({len(ids)} tokens) is longer than the model's "
                              f"context length ({self.context_length} tokens).",
                   "type": "BadRequestError", "code": 400, "retryable": False}
            await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        req = _Req(rid, list(ids))
        req.adapter = self.loras[lora] if lora is not None else ""
        entries: list[list[Any]] = []
        steps = self.core.generate(req, max_new=int(sp.get("max_new_tokens") or 128),
                                   stop_ids=set(sp.get("stop_token_ids") or []),
                                   stop_strs=list(sp.get("stop") or []))
        with contextlib.suppress(ConnectionResetError):  # the client went away: dropped
            async with contextlib.aclosing(steps):
                async for new, lps, finish in steps:
                    delta = [[lp, t, None] for t, lp in zip(new, lps, strict=True)]
                    entries.extend(delta)
                    await resp.write(self._event(body, req, delta, entries, finish))
            await resp.write(b"data: [DONE]\n\n")
        return resp

    def _event(self, body: dict[str, Any], req: _Req, delta: list[list[Any]],
               entries: list[list[Any]], finish: tuple[str, Any] | None) -> bytes:
        finish_json = None
        shown = delta if self.incremental else list(entries)
        output_ids = [e[1] for e in shown]
        if finish is not None:
            kind, matched = finish
            if kind == "abort":
                finish_json = {"type": "abort", "message": matched, "status_code": None,
                               "err_type": None}
                if req.waiting and entries:  # the waiting-queue abort: cumulative, last id
                    shown, output_ids = list(entries), [entries[-1][1]]
            else:
                finish_json = {"type": kind, "length" if kind == "length" else "matched": matched}
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": finish_json,
                                "prompt_tokens": len(req.input_ids),
                                "completion_tokens": len(entries), "cached_tokens": 0,
                                "weight_version": self.core.weight_version}
        if finish is not None:
            meta["weight_versions"] = _spans(req.versions)
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = shown
        if finish is not None and finish[0] != "abort" and self.return_routed_experts and \
                body.get("return_routed_experts"):
            layers, top_k, experts = self.routing_shape
            rows = len(req.input_ids) + len(entries) - 1
            values = [routed_expert(p, layer, j, experts) for p in range(rows)
                      for layer in range(layers) for j in range(top_k)]
            meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(values)}i",
                                                                  *values)).decode()
        out = {"text": self.core.decode(output_ids), "output_ids": output_ids, "meta_info": meta}
        return b"data: " + json.dumps(out).encode() + b"\n\n"

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/abort_request"].append(body)
        self.core.abort(body.get("rid"), bool(body.get("abort_all")), prefix=True)
        return web.Response()

    # ---------------------------------------------------------------- info, load, health
    async def server_info(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        c = self.core
        return web.json_response({
            "model_path": c.weights, "tp_size": self.tp_size, "dp_size": self.dp_size,
            "attn_dp_size": self.attn_dp_size, "page_size": None,
            "max_total_num_tokens": c.capacity // self.ranks,
            "context_length": self.context_length,
            "incremental_streaming_output": self.incremental,
            "enable_deterministic_inference": False, "version": self.version,
            "weight_version": c.weight_version})

    async def model_info(self, request: web.Request) -> web.Response:
        self.calls["/model_info"].append(None)
        return web.json_response({"model_path": self.core.weights, "is_generation": True,
                                  "weight_version": self.core.weight_version})

    def _on_change(self, event: str) -> None:
        """Republish the load snapshot on a prefill, a retract or an idle step, and every
        `LOADS_REFRESH_TOKENS` tokens of decoding (so it lags in between)."""
        due = self.core.tokens_generated - self._last_snapshot_tokens >= LOADS_REFRESH_TOKENS
        if event != "token" or due:
            self._take_snapshot()

    def _take_snapshot(self) -> None:
        c = self.core
        self._last_snapshot_tokens = c.tokens_generated
        queued = sum(len(r.input_ids) + len(r.output) for r in c.running.values()
                     if r.retracted)
        running = sum(1 for r in c.running.values() if not r.waiting)
        self._snapshot = {"timestamp": time.time(), "num_running_reqs": running,
                          "num_waiting_reqs": c.waiting, "num_used_tokens": c.used_tokens,
                          "num_total_tokens": c.used_tokens + queued}

    async def loads(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        include = request.query.get("include")
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if include and not {s.strip() for s in include.split(",")} <= valid:
            return web.json_response({"detail": f"Invalid include sections: {include}"},
                                     status=400)
        per_rank = self.core.capacity // self.ranks
        loads = []
        for rank in range(self.ranks):
            snap = self._snapshot if rank == 0 else {
                "timestamp": self._snapshot["timestamp"], "num_running_reqs": 0,
                "num_waiting_reqs": 0, "num_used_tokens": 0, "num_total_tokens": 0}
            loads.append({"dp_rank": rank, **snap, "max_total_num_tokens": per_rank,
                          "token_usage": snap["num_used_tokens"] / per_rank})
        return web.json_response({"timestamp": "", "version": self.version,
                                  "accelerator": "fake", "num_accelerators": self.tp_size,
                                  "loads": loads})

    async def metrics(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        s = self._snapshot
        lab = ('{model_name="fake",engine_type="unified",tp_rank="0",pp_rank="0",'
               'moe_ep_rank="0"}')
        lines = []
        for name, value in [("sglang:num_used_tokens", s["num_used_tokens"]),
                            ("sglang:num_running_reqs", s["num_running_reqs"]),
                            ("sglang:num_queue_reqs", s["num_waiting_reqs"]),
                            ("sglang:token_usage", s["num_used_tokens"] / self.core.capacity)]:
            lines += [f"# TYPE {name} gauge", f"{name}{lab} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n")

    async def health(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        self.calls["/health"].append(None)
        if self.starting:
            return web.Response(status=503)
        c = self.core
        deadline = time.monotonic() + self.health_check_timeout_s
        while time.monotonic() < deadline:  # the one-token generation gets scheduled
            await asyncio.sleep(self.health_poll_s)
            if c.unpaused.is_set() and c.scheduler_free.is_set():
                return web.Response()
        return web.Response(status=503)

    # ------------------------------------------------------------- pause, flush, weights
    def _busy(self) -> bool:
        """Requests the scheduler still holds (running, or queued and not retracted)."""
        return any(not r.retracted for r in self.core.running.values())

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.calls["/flush_cache"].append(None)
        if self._busy():
            return web.Response(text="Cache not flushed: requests are running or queued.\n",
                                status=400)
        return web.Response(text="Cache flushed.\n")

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls["/pause_generation"].append(body)
        self.pause_mode = body.get("mode", "abort")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            return web.json_response({"detail": f"unknown mode {self.pause_mode!r}"}, status=422)
        if self.pause_mode == "abort":
            self.core.abort(all_=True)
        self.core.free_kv_on_pause = self.pause_mode == "retract"
        for r in self.core.running.values():  # the scheduler retracts them at once
            r.retracted = self.core.free_kv_on_pause
        self.core.unpaused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls["/continue_generation"].append(None)
        self.pause_mode = ""
        self.core.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def _load(self, weights: str, body: dict[str, Any]) -> web.Response | None:
        """Block the scheduler `weight_load_delay_s`, swap weights, flush, tag the version.
        Returns the failure reply, or None."""
        self.core.scheduler_free.clear()
        try:
            await asyncio.sleep(self.weight_load_delay_s)
            self.core.weights = weights
            if body.get("weight_version") is not None:
                self.core.weight_version = str(body["weight_version"])
        finally:
            self.core.scheduler_free.set()
        if body.get("flush_cache", True) and self._busy():
            return _fail("Weights were updated, but the cache was not flushed because requests "
                         "are still running or queued. Retract or finish them, then call "
                         "/flush_cache.")
        return None

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/update_weights_from_disk"].append(body)
        path = body.get("model_path", "")
        if self.core.unpaused.is_set():  # no pause: the writer lock waits for requests
            while self.core.running:  # noqa: ASYNC110  (polling state another task owns)
                await asyncio.sleep(0.01)
        if not (path.startswith("/fake") or os.path.isdir(path)):  # noqa: ASYNC240  (a test fake)
            return _fail(f"Failed to get weights iterator: {path} (repository not found).",
                         num_paused_requests=0)
        return await self._load(path, body) or _ok("Succeeded to update model weights.",
                                                   num_paused_requests=0)

    def _lora_reply(self, error: str = "") -> web.Response:
        return web.json_response({"rid": None, "success": not error, "error_message": error,
                                  "loaded_adapters": dict(self.loras)},
                                 status=400 if error else 200)

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/load_lora_adapter"].append(body)
        name, path = body.get("lora_name", ""), body.get("lora_path", "")
        if not self.enable_lora:
            return self._lora_reply("LoRA is not enabled. Please set `--enable-lora` to True.")
        if name in self.loras:
            return self._lora_reply(f"Failed to load LoRA adapter {name} because it is "
                                    f"already loaded")
        if self.max_loaded_loras and len(self.loras) >= self.max_loaded_loras:
            return self._lora_reply(f"Maximum number of loaded LoRA adapters is "
                                    f"{self.max_loaded_loras}")
        conf = os.path.join(path, "adapter_config.json")
        try:
            with open(conf) as f:  # noqa: ASYNC230  (a test fake reading a small file)
                rank = int(json.load(f)["r"])
        except (OSError, ValueError, KeyError) as e:
            return self._lora_reply(f"Failed to load LoRA adapter {name}: {e}")
        if self.max_lora_rank and rank > self.max_lora_rank:
            return self._lora_reply(f"LoRA adapter {name} has rank {rank}, larger than "
                                    f"--max-lora-rank {self.max_lora_rank}")
        self.loras[name] = path
        return self._lora_reply()

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/unload_lora_adapter"].append(body)
        name = body.get("lora_name", "")
        if name not in self.loras:
            return self._lora_reply(f"LoRA adapter {name} is not loaded")
        path = self.loras[name]
        # the real server waits until no request in flight uses the adapter
        while any(r.adapter == path for r in self.core.running.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        del self.loras[name]
        return self._lora_reply()

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self.calls["/begin_weight_update"].append(await request.json())
        if self.session_open:
            return _fail("a weight-update session is already open; call end_weight_update() "
                         "first")
        self.session_open = True
        return _ok()

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self.calls["/end_weight_update"].append(await request.json())
        if not self.session_open:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return _ok()

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        payloads = body.get("serialized_named_tensors")
        if isinstance(payloads, list):  # recorded as sizes: the test reads calls over HTTP
            body = {**body, "serialized_named_tensors": [len(p) for p in payloads]}
        if not self.session_open:
            self.calls["/update_weights_from_tensor"].append({**body, "names": None})
            return _fail("update_weights_from_tensor must run between begin_weight_update() "
                         "and end_weight_update()")
        per_rank: list[list[tuple[str, Any]]] = []
        try:
            for rank in range(self.tp_size):  # rank r reads element r, and only that one
                per_rank.append(list(await asyncio.to_thread(deserialize, payloads[rank])))
        except Exception as e:  # as `tp_worker.py`: any failure is the reply, not a crash
            self.calls["/update_weights_from_tensor"].append({**body, "names": None})
            return _fail(f"Failed to deserialize the tensors of tp rank {len(per_rank)}: "
                         f"{type(e).__name__}: {e}")
        self.calls["/update_weights_from_tensor"].append(
            {**body, "names": [n for n, _ in per_rank[0]]})
        self.received.update(dict(per_rank[0]))
        failure = await self._load(tensor_digest(list(self.received.items())), body)
        return failure or _ok()

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/init_weights_update_group"].append(body)
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:  # torch refuses a second group of one name
            return _fail("Failed to initialize custom process group: The specified group "
                         "name has already been created, please use a different group name.")
        if body.get("backend") == "gloo":
            try:
                self.groups[name] = await asyncio.to_thread(_join_gloo, body)
            except Exception as e:  # any rendezvous failure is the reply, as on the real one
                return _fail(f"Failed to initialize custom process group: {e!r}.")
        else:
            self.groups[name] = None
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/destroy_weights_update_group"].append(body)
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return _fail("The group to be destroyed does not exist.")
        group = self.groups.pop(name)
        if group is not None:
            await asyncio.to_thread(_destroy_gloo, group)
        return _ok("Succeeded to destroy custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/update_weights_from_distributed"].append(body)
        if not self.session_open:
            return _fail("update_weights_from_distributed must run between "
                         "begin_weight_update() and end_weight_update()")
        import torch

        dtypes = [getattr(torch, d, None) for d in body.get("dtypes", [])]
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            return _fail(f"Failed to receive weights: bad dtype in {body.get('dtypes')}")
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return _fail(f"Failed to receive weights: group {name} is not initialized")
        group = self.groups[name]
        if group is None:  # "nccl": nothing can be received on a CPU
            weights = "nccl:" + hashlib.blake2b(json.dumps(body, sort_keys=True).encode(),
                                                digest_size=8).hexdigest()
        else:
            try:
                got = await asyncio.to_thread(_receive_gloo, group, body["names"], dtypes,
                                              body["shapes"])
            except Exception as e:  # a broken group is the reply, as on the real one
                return _fail(f"Failed to update parameter online: {e!r}.")
            self.received.update(got)
            weights = tensor_digest(list(self.received.items()))
        return await self._load(weights, body) or _ok("Succeeded to update parameter online.")


class SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's allow-list unpickler (`utils/common.py:3085-3098,3361-3370`): globals
    only from these module prefixes, and never the denied callables."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.",
               "operator.", "types.", "weakref.", "torch.", "multiprocessing.resource_sharer.",
               "multiprocessing.reduction.", "pickletools.", "peft.", "transformers.",
               "huggingface_hub.", "sglang.srt.", "lightllm.utils.")
    DENIED = frozenset({("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
                        ("os", "system"), ("subprocess", "Popen"), ("subprocess", "run"),
                        ("codecs", "decode"), ("types", "CodeType"), ("types", "FunctionType")})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.DENIED and (module + ".").startswith(self.ALLOWED):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe class loading ({module}.{name}), to prevent "
                           "exploitation of CVE-2025-10164")


def deserialize(data: str | bytes) -> Any:
    """`MultiprocessingSerializer.deserialize` of SGLang 0.5.23: base64 (validated) when a
    str, then the allow-list unpickler; torch's ForkingPickler rebuilds run in this process,
    so a CPU tensor sent by handle (a file descriptor behind the sender's resource sharer)
    fails here exactly as on the real server."""
    import torch.multiprocessing  # noqa: F401  (the rebuild functions torch registers)

    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return SafeUnpickler(io.BytesIO(data)).load()


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if out and out[-1]["version"] == v:
            out[-1]["end"] = i + 1
        else:
            out.append({"version": v, "start": i, "end": i + 1})
    return out


GROUP_TIMEOUT_S = 30.0
"""Timeout of a gloo group's rendezvous and receives (the real server: torch's default,
30 minutes)."""


def _join_gloo(body: dict[str, Any]) -> Any:
    """The server's rank (`rank_offset`; one TP rank) of a gloo group with the trainer (rank
    0), built as SGLang's `init_custom_process_group` builds it (`utils/common.py`): a TCP
    store client from `tcp://master_address:master_port`, `PrefixStore(group_name, store)`,
    and torch's own `_new_process_group_helper`, which adds its own prefixes. So a trainer
    that meets this fake meets the real server's ranks."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    name, world = body["group_name"], int(body["world_size"])
    for stale, n in list(_world.pg_names.items()):  # left behind by a control-API reset
        if n == name:
            dist.destroy_process_group(stale)
    store, rank, world = next(rendezvous(
        f"tcp://{body['master_address']}:{int(body['master_port'])}",
        int(body["rank_offset"]), world, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"),
                                      PrefixStore(name, store), group_name=name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    assert isinstance(pg, dist.ProcessGroup)
    return pg


def _destroy_gloo(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def _receive_gloo(group: Any, names: list[str], dtypes: list[Any],
                  shapes: list[list[int]]) -> dict[str, Any]:
    """As `model_runner.update_weights_from_distributed`: every receive posted (a broadcast
    from rank 0, in the announced order), then all waited for."""
    import torch
    import torch.distributed as dist

    out, works = {}, []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=dtype)
        works.append(dist.broadcast(t, src=0, group=group, async_op=True))
        out[name] = t
    for w in works:
        w.wait()
    return out


def routed_expert(position: int, layer: int, j: int, experts: int) -> int:
    """The fake's expert for slot `j` of `layer` at `position`: distinct over j, varied."""
    return (position * 3 + layer * 5 + j * (experts // 2 + 1)) % experts


def main(argv: list[str] | None = None) -> None:
    """Run as a child process with (a subset of) `sglang.launch_server`'s flags; any other
    flag is an error, as with the real launcher."""
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=0)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--max-loaded-loras", type=int, default=0)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--fake-crash-after-tokens", type=int, default=0)
    p.add_argument("--fake-startup-delay", type=float, default=0.0)
    p.add_argument("--fake-token-delay", type=float, default=0.0)
    p.add_argument("--fake-capacity", type=int, default=4096)
    p.add_argument("--fake-health-check-timeout", type=float, default=20.0)
    args = p.parse_args(argv)

    async def serve() -> None:
        fake = FakeSGLang(incremental=args.incremental_streaming_output, tp_size=args.tp_size,
                          dp_size=args.dp_size, context_length=args.context_length,
                          model_path=args.model_path, token_delay_s=args.fake_token_delay,
                          capacity=args.fake_capacity,
                          health_check_timeout_s=args.fake_health_check_timeout,
                          crash_after_tokens=args.fake_crash_after_tokens,
                          enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
                          max_loaded_loras=args.max_loaded_loras,
                          return_routed_experts=args.enable_return_routed_experts)
        fake.starting = True  # listening, but /health answers 503 until loaded
        await fake.start(args.host, args.port)
        print(f"fake sglang serving {args.model_path} at {fake.url}", flush=True)
        await asyncio.sleep(args.fake_startup_delay)
        fake.starting = False
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
