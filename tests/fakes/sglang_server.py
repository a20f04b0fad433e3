"""Fake SGLang server: a real aiohttp app speaking SGLang 0.5.x's native HTTP API.

Fakes the inference-server boundary for the `sglang` engine (and, through `FakeCore`, the
vLLM fake next to it). Tokens come from a scripted, deterministic "model" whose choices depend
on the loaded weights, so a weight update visibly changes outputs. Load is reported the way
SGLang does (`/metrics` gauges, `/get_load`, `/get_server_info`), and failures can be injected:
`die()` drops every connection and stops listening (a crashed server), `hang = True` stops
answering (a wedged one), `--fake-crash-after-tokens` makes the process exit mid-stream.

Runs in-process (`async with FakeSGLang() as fake: fake.url`) or as a program taking SGLang's
launch flags (`python sglang_server.py --model-path P --port N ...`), which is how the launch,
supervision and restart path is tested with a real child process.

Wire format follows SGLang's http_server.py / tokenizer_manager (0.5.x): see
`asyncrl/engine/sglang.py` for the list of endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import pickle
import sys
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

EOS = 2


class ScriptedModel:
    """Deterministic next-token rule: a hash of (weights, last tokens, position).

    With `script`, the i-th generated token is `script[i % len(script)]` instead. Logprobs are
    a fixed function of the same hash, always < 0.
    """

    def __init__(self, vocab_size: int = 64, script: list[int] | None = None) -> None:
        self.vocab_size = vocab_size
        self.script = script

    def step(self, weights: str, context: list[int], position: int) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(
            f"{weights}|{context[-4:]}|{len(context)}".encode(), digest_size=8).digest(), "big")
        logprob = -0.001 - (h >> 20) % 4000 / 1000.0
        if self.script:
            return self.script[position % len(self.script)], logprob
        return 10 + h % (self.vocab_size - 10), logprob  # ids < 10 are specials


def default_decode(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


class _Req:
    def __init__(self, rid: str, input_ids: list[int], transport: Any) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.output: list[int] = []
        self.aborted = False
        self.transport = transport


class FakeCore:
    """The part both fakes share: requests, KV accounting, pause, weights, failure knobs."""

    def __init__(self, *, model: ScriptedModel | None = None, capacity: int = 4096,
                 token_delay_s: float = 0.0, decode: Callable[[list[int]], str] = default_decode,
                 model_path: str = "/fake/model", crash_after_tokens: int = 0) -> None:
        self.model = model or ScriptedModel()
        self.capacity = capacity
        self.token_delay_s = token_delay_s
        self.decode = decode
        self.weights = model_path
        self.weight_version = "default"
        self.crash_after_tokens = crash_after_tokens
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.running: dict[str, _Req] = {}
        self.waiting = 0
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.responsive = asyncio.Event()
        self.responsive.set()
        self.dead = False
        self.tokens_generated = 0

    @property
    def used_tokens(self) -> int:
        return sum(len(r.input_ids) + len(r.output) for r in self.running.values())

    @property
    def hang(self) -> bool:
        return not self.responsive.is_set()

    @hang.setter
    def hang(self, value: bool) -> None:
        if value:
            self.responsive.clear()
        else:
            self.responsive.set()

    async def stall_if_hung(self) -> None:
        await self.responsive.wait()

    async def generate(self, req: _Req, *, max_new: int, stop_ids: set[int],
                       stop_strs: list[str]) -> AsyncIterator[tuple[list[int], list[float],
                                                                    tuple[str, Any] | None]]:
        """Yields (new ids, their logprobs, finish) per step; finish = (kind, matched)."""
        self.running[req.rid] = req
        try:
            while True:
                if not self.unpaused.is_set():
                    self.waiting += 1
                    try:
                        await self.unpaused.wait()
                    finally:
                        self.waiting -= 1
                await self.stall_if_hung()
                if req.aborted:
                    yield [], [], ("abort", "Abort in waiting queue")
                    return
                tok, lp = self.model.step(self.weights, req.input_ids + req.output,
                                          len(req.output))
                req.output.append(tok)
                self.tokens_generated += 1
                if self.crash_after_tokens and self.tokens_generated >= self.crash_after_tokens:
                    os._exit(17)  # a server process dying mid-stream
                finish: tuple[str, Any] | None = None
                if tok in stop_ids or tok == EOS:
                    finish = ("stop", tok)
                elif stop_strs:
                    text = self.decode(req.output)
                    hit = next((s for s in stop_strs if s in text), None)
                    if hit is not None:
                        finish = ("stop", hit)
                if finish is None and len(req.output) >= max_new:
                    finish = ("length", len(req.output))
                yield [tok], [lp], finish
                if finish is not None:
                    return
                await asyncio.sleep(self.token_delay_s)
        finally:
            self.running.pop(req.rid, None)

    def abort(self, rid: str | None = None, all_: bool = False) -> int:
        n = 0
        for r in self.running.values():
            if all_ or r.rid == rid:
                r.aborted = True
                n += 1
        return n


class FakeSGLang:
    """The SGLang fake. Attributes of `core` (and `incremental`, `metrics`) steer it."""

    def __init__(self, *, core: FakeCore | None = None, incremental: bool = True,
                 metrics: bool = True, version: str = "0.5.23", get_load_style: str = "list",
                 can_pause: bool = True, **core_kw: Any) -> None:
        self.core = core or FakeCore(**core_kw)
        self.incremental = incremental
        self.metrics = metrics
        self.version = version
        self.get_load_style = get_load_style
        self.can_pause = can_pause
        self.pause_mode = ""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def calls(self) -> dict[str, list[Any]]:
        return self.core.calls

    # ------------------------------------------------------------------------- serving
    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/metrics", self.get_metrics)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        if self.can_pause:
            r.add_post("/pause_generation", self.pause)
            r.add_post("/continue_generation", self.resume)
        r.add_post("/add_worker", self.add_worker)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.core.dead = False
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        sock = self._site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    async def die(self) -> None:
        """Crash: every open connection is dropped and the port stops accepting."""
        self.core.dead = True
        for req in list(self.core.running.values()):
            if req.transport is not None:
                req.transport.abort()
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSGLang:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------------ handlers
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls["/generate"].append(body)
        ids = body.get("input_ids")
        sp = body.get("sampling_params") or {}
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return web.json_response({"error": {"message": "input_ids must be a list of ints"}},
                                     status=400)
        if len(ids) + int(sp.get("max_new_tokens", 128)) > self.core.capacity:
            return web.json_response({"error": {"message": "The input is longer than the "
                                                           "context length"}}, status=400)
        rid = body.get("rid") or uuid.uuid4().hex
        req = _Req(rid, list(ids), request.transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        entries: list[list[Any]] = []
        steps = self.core.generate(req, max_new=int(sp.get("max_new_tokens", 128)),
                                   stop_ids=set(sp.get("stop_token_ids") or []),
                                   stop_strs=list(sp.get("stop") or []))
        async with contextlib.aclosing(steps):
            async for new, lps, finish in steps:
                delta = [[lp, t, None] for t, lp in zip(new, lps, strict=True)]
                entries.extend(delta)
                await resp.write(self._event(body, rid, len(ids), delta, entries, finish))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _event(self, body: dict[str, Any], rid: str, n_prompt: int, delta: list[list[Any]],
               entries: list[list[Any]], finish: tuple[str, Any] | None) -> bytes:
        finish_json = None
        if finish is not None:
            kind, matched = finish
            key = {"abort": "message", "length": "length"}.get(kind, "matched")
            finish_json = {"type": kind, key: matched}
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish_json,
                                "prompt_tokens": n_prompt, "completion_tokens": len(entries),
                                "cached_tokens": 0, "weight_version": self.core.weight_version}
        shown = delta if self.incremental else list(entries)
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = shown
        out = {"text": self.core.decode([e[1] for e in shown]),
               "output_ids": [e[1] for e in shown], "meta_info": meta}
        return b"data: " + json.dumps(out).encode() + b"\n\n"

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/abort_request"].append(body)
        self.core.abort(body.get("rid"), bool(body.get("abort_all")))
        return web.Response()

    async def get_server_info(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        return web.json_response({
            "model_path": self.core.weights, "tp_size": 1, "dp_size": 1, "page_size": 1,
            "max_total_num_tokens": self.core.capacity, "max_req_input_len": self.core.capacity,
            "incremental_streaming_output": self.incremental, "version": self.version,
            "internal_states": [{"last_gen_throughput": 0.0}]})

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.core.weights, "is_generation": True,
                                  "weight_version": self.core.weight_version})

    async def get_load(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        c = self.core
        if self.get_load_style == "dict":
            return web.json_response({"load": c.used_tokens})
        return web.json_response([{"dp_rank": 0, "num_reqs": len(c.running),
                                   "num_waiting_reqs": c.waiting, "num_tokens": c.used_tokens}])

    async def get_metrics(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        if not self.metrics:
            return web.Response(status=404)
        c = self.core
        lab = '{model_name="fake",engine_type="unified",tp_rank="%d"}'
        lines = []
        for name, value in [("sglang:num_used_tokens", c.used_tokens),
                            ("sglang:num_running_reqs", len(c.running) - c.waiting),
                            ("sglang:num_queue_reqs", c.waiting),
                            ("sglang:token_usage", c.used_tokens / c.capacity),
                            ("sglang:max_total_num_tokens", c.capacity)]:
            lines += [f"# TYPE {name} gauge"] + [f"{name}{lab % r} {float(value)}" for r in (0, 1)]
        return web.Response(text="\n".join(lines) + "\n")

    async def health(self, request: web.Request) -> web.Response:
        await self.core.stall_if_hung()
        return web.Response()

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.calls["/flush_cache"].append(None)
        busy = self.core.running and self.core.unpaused.is_set()
        return web.Response(text="Cache flushed.\n", status=400 if busy else 200)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/update_weights_from_disk"].append(body)
        path = body.get("model_path", "")
        if not (path.startswith("/fake") or os.path.isdir(path)):  # noqa: ASYNC240  (a test fake)
            return web.json_response({"success": False, "message": f"{path} not found",
                                      "num_paused_requests": 0}, status=400)
        self.core.weights = path
        self.core.weight_version = body.get("weight_version") or self.core.weight_version
        return web.json_response({"success": True, "message": "Succeeded to update model "
                                  "weights.", "num_paused_requests": 0})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        names = []
        for payload in body["serialized_named_tensors"][:1]:
            names = [n for n, _ in pickle.loads(base64.b64decode(payload))]
        self.calls["/update_weights_from_tensor"].append({**body, "names": names})
        self.core.weights = f"tensors:{len(self.calls['/update_weights_from_tensor'])}"
        if body.get("weight_version"):
            self.core.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "ok"})

    async def init_group(self, request: web.Request) -> web.Response:
        self.calls["/init_weights_update_group"].append(await request.json())
        return web.json_response({"success": True, "message": "ok"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["/update_weights_from_distributed"].append(body)
        self.core.weights = f"nccl:{body.get('weight_version')}"
        self.core.weight_version = body.get("weight_version") or self.core.weight_version
        return web.json_response({"success": True, "message": "ok"})

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.calls["/pause_generation"].append(body)
        self.pause_mode = body.get("mode", "abort")
        if self.pause_mode == "abort":
            self.core.abort(all_=True)
        self.core.unpaused.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls["/continue_generation"].append(None)
        self.core.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def add_worker(self, request: web.Request) -> web.Response:
        self.calls["/add_worker"].append(request.query.get("url"))
        return web.Response()


def main(argv: list[str] | None = None) -> None:
    """Run as a child process with (a subset of) `sglang.launch_server`'s flags."""
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--fake-crash-after-tokens", type=int, default=0)
    p.add_argument("--fake-startup-delay", type=float, default=0.0)
    p.add_argument("--fake-token-delay", type=float, default=0.0)
    p.add_argument("--fake-capacity", type=int, default=4096)
    args, _unknown = p.parse_known_args(argv)  # the real server's other flags are ignored

    async def serve() -> None:
        await asyncio.sleep(args.fake_startup_delay)
        fake = FakeSGLang(incremental=args.incremental_streaming_output,
                          metrics=args.enable_metrics, model_path=args.model_path,
                          token_delay_s=args.fake_token_delay, capacity=args.fake_capacity,
                          crash_after_tokens=args.fake_crash_after_tokens)
        await fake.start(args.host, args.port)
        print(f"fake sglang serving {args.model_path} at {fake.url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
