"""Fake sglang-router 0.3.2: a real aiohttp app with the router's worker API and pass-through.

Fakes the router boundary for `RoutedSGLangEngine`, from the 0.3.2 binary's routes and the
gateway source the audit (`docs/research/sglang-contract-audit.md`, rows 27-28) read:
- `POST /workers {"url", ...}` answers 202 `{"status": "accepted", "worker_id", "url",
  "message"}` and adds the worker in the background: it appears in `GET /workers` at once
  with `is_healthy: false`, and turns healthy after its first successful `/health` probe;
  there is no `/add_worker` (a 404, as from the real router's fallback handler).
- `POST /generate` goes to a healthy worker (round robin), re-serialised as the router's typed
  request: sampling keys it does not model (`spaces_between_special_tokens`) are dropped.
- `DELETE /workers/{uuid}` removes a worker (202); a url in the path is a 400, as in 0.3.2.
- `GET /health` 200, `GET /readiness` 503 without a healthy worker.

Runs as its own program (`python tests/fakes/sglang_router.py --port 0`), steered through
`fakes.control`'s `/_fake/` routes (state: `calls`, `workers`; `replies` answers a path with a
canned reply; knobs `add_delay_s`, `check_interval_s`; reset forgets every worker and
restores the launch intervals).

Simplifications: one health probe per worker at registration plus one per `check_interval_s`
(the real router's interval is configurable, 60 s by default); no circuit breaker, retries or
cache-aware policy; abort is not routed (the engine aborts on every server directly).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import uuid
from collections import defaultdict
from typing import Any

import aiohttp
from aiohttp import web

if not __package__:  # run as a program: make `fakes` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakes.control import canned_reply, mount_control  # after the path set-up above

ROUTER_SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p",
                        "top_k", "min_p", "frequency_penalty", "presence_penalty",
                        "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
                        "ebnf", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                        "stream_interval", "sampling_seed"}


class FakeRouter:
    def __init__(self, *, check_interval_s: float = 0.2, add_delay_s: float = 0.1) -> None:
        self._launched = (check_interval_s, add_delay_s)
        self.check_interval_s = check_interval_s
        self.add_delay_s = add_delay_s
        self.workers: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.replies: dict[str, tuple[int, Any]] = {}
        """Failure injection: path -> (status, body) answered instead of the real handler."""
        self.url = ""
        self._rr = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def _reset(self) -> None:
        """The router as launched (the control API's reset, between tests): no workers."""
        for t in self._tasks:
            t.cancel()  # each probe loop ends at its next await
        self._tasks = set()
        self.workers = {}
        self.calls = defaultdict(list)
        self.replies = {}
        self._rr = 0
        self.check_interval_s, self.add_delay_s = self._launched

    @web.middleware
    async def _injected(self, request: web.Request, handler: Any) -> web.StreamResponse:
        return await canned_reply(self, request) or await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._injected])
        mount_control(app, self, self._reset)
        app.router.add_post("/workers", self.add_worker)
        app.router.add_get("/workers", self.list_workers)
        app.router.add_delete("/workers/{worker_id}", self.remove_worker)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/readiness", self.readiness)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def add_worker(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls["POST /workers"].append(body)
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith("http"):
            return web.json_response({"error": "invalid worker url"}, status=400)
        worker_id = str(uuid.uuid4())
        task = asyncio.create_task(self._add(worker_id, url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.json_response({"status": "accepted", "worker_id": worker_id, "url": url,
                                  "message": "Worker addition queued for background "
                                             "processing"}, status=202)

    async def _add(self, worker_id: str, url: str) -> None:
        await asyncio.sleep(self.add_delay_s)  # the job queue
        self.workers[url] = {"id": worker_id, "url": url, "model_id": "default",
                             "worker_type": "regular", "is_healthy": False, "load": 0}
        while True:
            healthy = await self._probe(url)
            if self.workers.get(url, {}).get("id") != worker_id:
                return  # removed meanwhile
            self.workers[url]["is_healthy"] = healthy
            await asyncio.sleep(self.check_interval_s)

    async def _probe(self, url: str) -> bool:
        assert self._session is not None
        try:
            async with asyncio.timeout(5), self._session.get(url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def remove_worker(self, request: web.Request) -> web.Response:
        """0.3.2 names the worker by its UUID; a url in the path is a 400 (as the real one)."""
        wid = request.match_info["worker_id"]
        self.calls["DELETE /workers"].append(wid)
        try:
            uuid.UUID(wid)
        except ValueError:
            return web.json_response({"error": f"Invalid worker_id '{wid}' (expected UUID).",
                                      "code": "BAD_REQUEST"}, status=400)
        for url, w in list(self.workers.items()):
            if w["id"] == wid:
                del self.workers[url]
                return web.json_response({"status": "accepted", "worker_id": wid}, status=202)
        return web.json_response({"error": f"Worker {wid} not found"}, status=404)

    async def list_workers(self, request: web.Request) -> web.Response:
        ws = list(self.workers.values())
        return web.json_response({"workers": ws, "total": len(ws),
                                  "stats": {"healthy_count": sum(w["is_healthy"] for w in ws)}})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def readiness(self, request: web.Request) -> web.Response:
        ok = any(w["is_healthy"] for w in self.workers.values())
        return web.json_response({"status": "ready" if ok else "not_ready"},
                                 status=200 if ok else 503)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        healthy = [w["url"] for w in self.workers.values() if w["is_healthy"]]
        if not healthy:
            return web.json_response({"error": "No available workers"}, status=503)
        url = healthy[self._rr % len(healthy)]
        self._rr += 1
        sp = {k: v for k, v in (body.get("sampling_params") or {}).items()
              if k in ROUTER_SAMPLING_KEYS}
        forwarded = {**body, "sampling_params": sp}
        self.calls["/generate"].append({"worker": url, "body": forwarded})
        assert self._session is not None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        async with self._session.post(url + "/generate", json=forwarded) as up:
            if up.status != 200:
                return web.Response(status=up.status, body=await up.read(),
                                    content_type="application/json")
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
        return resp


def main(argv: list[str] | None = None) -> None:
    """Run as a child process (a subset of `sglang_router.launch_router`'s flags, plus the
    fake's intervals)."""
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--fake-check-interval", type=float, default=0.2)
    p.add_argument("--fake-add-delay", type=float, default=0.1)
    args = p.parse_args(argv)

    async def serve() -> None:
        router = FakeRouter(check_interval_s=args.fake_check_interval,
                            add_delay_s=args.fake_add_delay)
        await router.start(args.host, args.port)
        print(f"fake sglang-router at {router.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await router.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
