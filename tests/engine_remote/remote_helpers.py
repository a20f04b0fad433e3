"""Helpers shared by the remote-engine tests: fast supervision options, request builder,
polling, a fake's warm-up before a weight-group test, an sglang-router's worker list."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from fakes.control import FakeProcess

from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.remote.engine import RemoteOptions

FAST = RemoteOptions(health_interval_s=0.2, health_timeout_s=1.0, health_failures=2,
                     control_timeout_s=5.0, weight_timeout_s=10.0, load_ttl_s=0.2,
                     startup_timeout_s=30.0, stop_grace_s=3.0, max_restarts=3)
"""Supervision tuned for tests: a dead or silent server is noticed within about a second."""

_ids = itertools.count()


def make_request(input_ids: list[int] | None = None, *, max_new: int = 8, rid: str = "",
                 stop_ids: tuple[int, ...] = (), stop_strs: tuple[str, ...] = (),
                 temperature: float = 1.0) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid or f"r{next(_ids)}", input_ids=input_ids or [11, 12, 13],
        sampling=SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                stop_token_ids=stop_ids, stop_strings=stop_strs))


async def eventually(predicate: Callable[[], bool | Awaitable[bool]],
                     timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds (engine state changes in the supervisor's own time, a
    fake's in its own process: an async predicate is awaited)."""

    async def holds() -> bool:
        got = predicate()
        return bool(await got) if inspect.isawaitable(got) else bool(got)

    async with asyncio.timeout(timeout_s):
        while not await holds():  # noqa: ASYNC110  (polling state owned by another task)
            await asyncio.sleep(0.05)


async def listed(session: aiohttp.ClientSession, router_url: str) -> set[str]:
    """The worker urls an sglang-router lists (`GET /workers`)."""
    async with session.get(router_url + "/workers") as r:
        return {w["url"].rstrip("/") for w in (await r.json())["workers"]}


async def warm_up(fake: FakeProcess) -> None:
    """Have the fake import torch before a test times anything (a real server has it loaded;
    the import stalls the fake for seconds on a busy machine): an NCCL call it answers after
    its dtype check, on a group it does not have, inside a session."""
    async with aiohttp.ClientSession() as s:
        for path, body in (("/begin_weight_update", {}),
                           ("/update_weights_from_distributed", {"group_name": "warm-up"}),
                           ("/end_weight_update", {})):
            async with s.post(fake.url + path, json=body) as r:
                await r.read()


def kill_at_broadcast(monkeypatch: Any, victim: FakeProcess, n: int = 2) -> Callable[[], None]:
    """Make the weight group's `n`-th bucket broadcast after `arm()` SIGKILL `victim` first:
    every server has sent its call for that bucket, so the victim dies in the middle of an
    update (once: later broadcasts run as they are). Returns `arm`."""
    from asyncrl.weightsync import group as wg

    real = wg._send_bucket
    seen = {"n": 0, "armed": False}

    def send(backend: Any, bucket: Any, device: Any) -> None:
        seen["n"] += seen["armed"]
        if seen["n"] == n:
            assert victim.proc is not None
            os.killpg(victim.proc.pid, signal.SIGKILL)
        real(backend, bucket, device)

    monkeypatch.setattr(wg, "_send_bucket", send)
    return lambda: seen.__setitem__("armed", True)
