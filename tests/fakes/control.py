"""The test side's hold on a fake server running as its own process.

A real deployment always has a process boundary between the trainer and the inference
server: tensors, file descriptors and sockets that work inside one process may not cross it.
So the contract and weight tests run each fake as a separate program (`python
tests/fakes/<fake>.py --port 0 ...`), started once per module, and steer it through a small
control API every fake mounts under `/_fake/` (never a route of the real servers):

- `GET  /_fake/state?get=a,core.b`  → `{"calls": {path: [body, ...]}, "attrs": {name: value}}`
  (a value that is not JSON comes as its repr: `core.running` is `{rid: "<_Req ...>"}`)
- `POST /_fake/set {name: value}`   → sets knobs (`replies` {path: [status, body] | null},
  `hang`, `scheduler_free` and any
  existing JSON-valued attribute of the fake or, as `core.x` / `core.model.x`, of its core:
  `core.token_delay_s`, `core.capacity`, `core.vocab`, `core.model.script`,
  `core.crash_after_tokens`, ...; each fake's docstring names its own)
- `POST /_fake/reset`               → the fake as launched (between tests); requests still
  held by the old state are aborted and let go

A crash is the process's own end: a test that needs one starts a process of its own and
kills it (`FakeProcess.stop`) or sets `core.crash_after_tokens`; a server that comes back is
a new process on the same port (`FakeProcess(..., port=p)`).

`FakeProcess` launches a fake, reads the URL it prints, and wraps the control API;
`mount_control` adds the routes to a fake's app.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

FAKES = Path(__file__).resolve().parent


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # a tensor
        return value.tolist()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def _resolve(fake: Any, name: str) -> tuple[Any, str]:
    obj = fake
    *parents, attr = name.split(".")
    for p in parents:
        obj = getattr(obj, p)
    return obj, attr


def mount_control(app: web.Application, fake: Any, reset: Callable[[], None]) -> None:
    """The `/_fake/` routes on `app`, steering `fake` (its `calls`, `replies`, `core`)."""

    async def state(request: web.Request) -> web.Response:
        names = [n for n in request.query.get("get", "").split(",") if n]
        attrs = {}
        for n in names:
            obj, attr = _resolve(fake, n)
            attrs[n] = _jsonable(getattr(obj, attr))
        return web.json_response({"calls": _jsonable(dict(fake.calls)), "attrs": attrs})

    async def set_(request: web.Request) -> web.Response:
        for name, value in (await request.json()).items():
            if name == "replies":  # {path: [status, body]} adds, {path: null} removes
                for path, reply in value.items():
                    if reply is None:
                        fake.replies.pop(path, None)
                    else:
                        fake.replies[path] = tuple(reply)
            elif name == "hang":
                fake.core.hang = bool(value)
            elif name == "scheduler_free":
                (fake.core.scheduler_free.set if value else fake.core.scheduler_free.clear)()
            else:
                obj, attr = _resolve(fake, name)
                if not hasattr(obj, attr):
                    return web.json_response({"error": f"no knob {name}"}, status=400)
                setattr(obj, attr, value)
        return web.json_response({"ok": True})

    async def reset_(request: web.Request) -> web.Response:
        reset()
        return web.json_response({"ok": True})

    app.router.add_get("/_fake/state", state)
    app.router.add_post("/_fake/set", set_)
    app.router.add_post("/_fake/reset", reset_)


async def canned_reply(fake: Any, request: web.Request) -> web.Response | None:
    """The reply `fake.replies` holds for this request's path (set over `/_fake/set`), its body
    recorded in `fake.calls`; None when the path has none (the control routes never do)."""
    canned = fake.replies.get(request.path)
    if canned is None or request.path.startswith("/_fake/"):
        return None
    if request.can_read_body:
        fake.calls[request.path].append(await request.read())
    status, body = canned
    if isinstance(body, str):
        return web.Response(status=status, text=body)
    return web.json_response(body, status=status)


class FakeProcess:
    """A fake server program (`tests/fakes/<script>`) running as a separate process.

    Synchronous to start and stop (module-scoped fixtures); the control calls are async.
    `calls`/`attrs` are read from the process each time (`await fake.state(...)`).
    """

    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None,
                 port: int = 0, startup_timeout_s: float = 30.0) -> None:
        self.script = script
        self.args = list(args)
        self.port = port
        self.env = env or {}
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> FakeProcess:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKES / self.script), "--port", str(self.port), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        lines = []
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"(http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                return self
        self.stop()
        raise RuntimeError(f"{self.script} did not start: {''.join(lines)[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> FakeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------- control
    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        async with aiohttp.ClientSession() as s, s.request(method, self.url + path,
                                                           **kw) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{self.script} control {path}: {data}")
            return data

    async def state(self, *names: str) -> dict[str, Any]:
        return await self._call("GET", "/_fake/state", params={"get": ",".join(names)})

    async def calls(self, path: str | None = None) -> Any:
        calls = (await self.state())["calls"]
        return calls.get(path, []) if path is not None else calls

    async def attr(self, name: str) -> Any:
        return (await self.state(name))["attrs"][name]

    async def set(self, **knobs: Any) -> None:
        await self._call("POST", "/_fake/set", json={k.replace("__", "."): v
                                                     for k, v in knobs.items()})

    async def reply(self, path: str, status: int | None, body: Any = None) -> None:
        """Answer `path` with this canned reply (`status` None: the real handler again)."""
        await self.set(replies={path: None if status is None else [status, body]})

    async def reset(self) -> None:
        await self._call("POST", "/_fake/reset")
