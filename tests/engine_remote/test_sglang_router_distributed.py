"""The distributed weight sync behind the real sglang-router 0.3.2: each SGLang fake (its own
process) behind the router joins trainer rank 0's gloo group (`WeightGroup`), and the routed
engine's `record_update` takes a worker whose broadcast failed out of the router and puts it
back after its next good push.

- one push: one group of both workers (world size 1 + 2), every bucket reaches both, both
  report the version, and requests streamed through the router across the push finish;
- a worker SIGKILLed mid-broadcast: the push names it, the other worker gets the version in
  a re-formed group, the dead one is out of the router while requests keep being served by
  the survivor; restarted on its port, it rejoins at a later push and is back in the router.

Skipped when sglang-router is not installed (the `router` fixture, conftest.py).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog.testing
import torch
from fakes.control import FakeProcess
from remote_helpers import FAST, eventually, kill_at_broadcast, listed, make_request, warm_up

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.router import RoutedSGLangEngine
from asyncrl.weightsync.group import WeightGroup
from asyncrl.weightsync.push import push_weights

OPTS = msgspec.structs.replace(FAST, weight_timeout_s=6.0, health_interval_s=0.1)
"""The group's timeout is half of `weight_timeout_s`: 3 s."""


def state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Three buckets at 6 KiB: the 8 KiB embedding alone, then the rest in two."""
    g = torch.Generator().manual_seed(1)
    return {"embed.weight": torch.randn(64, 32, generator=g) * scale,
            "layer.0.weight": torch.randn(32, 32, generator=g) * scale,
            "layer.0.bias": torch.randn(32, generator=g) * scale,
            "layer.1.weight": (torch.randn(32, 32, generator=g) * scale).to(torch.bfloat16),
            "norm.weight": torch.ones(32) * scale}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(port: int) -> FakeProcess:
    return FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                       "--incremental-streaming-output", port=port)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[FakeProcess]]:
    fakes = [_launch(_free_port()).start() for _ in range(2)]
    try:
        for f in fakes:
            asyncio.run(warm_up(f))
        yield fakes
    finally:
        for f in fakes:
            f.stop()


def engines(workers: list[FakeProcess], session: aiohttp.ClientSession) -> list[SGLangEngine]:
    cfg = SGLangEngineConfig(weight_sync="distributed")
    return [SGLangEngine(cfg, index=i, session=session, url=w.url, model_path="/fake/model",
                         options=OPTS) for i, w in enumerate(workers)]


def same(got: dict[str, Any], sent: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(sent) and all(
        torch.equal(torch.tensor(got[k], dtype=v.dtype), v) for k, v in sent.items())


async def versions_of(routed: RoutedSGLangEngine, max_new: int) -> tuple[str, list[int]]:
    """Stream one request through the router: its finish reason and the version of each
    delta."""
    reason, seen = "", []
    async for d in routed.stream(make_request(max_new=max_new)):
        seen.append(d.policy_version)
        reason = d.finish_reason or reason
    return reason, seen


async def test_a_push_through_the_router_reaches_both_workers_in_one_group(
        router, workers, session, tmp_path):
    a, b = workers
    for f in workers:
        await f.reset()
    servers = engines(workers, session)
    sent = state()
    trainer = SimpleNamespace(state_dict_for_sync=lambda: sent)
    async with RoutedSGLangEngine(router, servers, register=True) as routed, \
            WeightGroup(bucket_bytes=6 << 10) as group:
        assert await listed(session, router) == {a.url, b.url}
        for f in workers:  # requests that are still running when the push comes
            await f.set(core__token_delay_s=0.05)
        streams = [asyncio.create_task(versions_of(routed, 100)) for _ in range(4)]
        await eventually(lambda: _running_on_both(workers), 10)
        await push_weights([routed], trainer, 1, "distributed", tmp_path,  # type: ignore[arg-type]
                           group=group)
        assert group.members == ["sglang-0", "sglang-1"]
        assert [s.policy_version for s in servers] == [1, 1] and routed.policy_version == 1
        for f, offset in ((a, 1), (b, 2)):
            st = await f.state("received", "core.weight_version")
            assert same(st["attrs"]["received"], sent)
            assert st["attrs"]["core.weight_version"] == "1"
            (init,) = st["calls"]["/init_weights_update_group"]
            assert (init["world_size"], init["rank_offset"]) == (3, offset)
            assert init["group_name"] == f"{group.name}-1"
            bodies = st["calls"]["/update_weights_from_distributed"]
            assert len(bodies) == group.last_push["buckets"] == 3
            assert [n for body in bodies for n in body["names"]] == list(sent)
        # the requests in flight were served across the push, through the router
        done = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert [r for r, _ in done] == ["length"] * 4
        # each stream's tokens carry the version that made them (0 then 1, never back), and
        # the push landed inside a stream (a loaded machine may finish one before it lands)
        assert all(v == sorted(v) and set(v) <= {0, 1} for _, v in done)
        assert any(v[0] == 0 and v[-1] == 1 for _, v in done)
        for f in workers:
            await f.set(core__token_delay_s=0.0)
        assert [await versions_of(routed, 3) for _ in range(2)] == [("length", [1] * 3)] * 2


async def _running_on_both(workers: list[FakeProcess]) -> bool:
    return all([bool(await f.attr("core.running")) for f in workers])


async def test_a_worker_killed_mid_broadcast_leaves_the_router_and_rejoins_later(
        router, workers, session, tmp_path, monkeypatch):
    a, b = workers
    for f in workers:
        await f.reset()
    servers = engines(workers, session)
    ea, eb = servers
    arm = kill_at_broadcast(monkeypatch, a)  # A dies at bucket 2 of the armed push
    async with RoutedSGLangEngine(router, servers, register=True) as routed, \
            WeightGroup(bucket_bytes=6 << 10) as group:
        assert await group.push([routed], state(), 1) == []
        assert group.members == ["sglang-0", "sglang-1"] and routed.policy_version == 1
        for f in workers:  # requests running through the router when A dies
            await f.set(core__token_delay_s=0.05)
        streams = [asyncio.create_task(versions_of(routed, 40)) for _ in range(4)]
        await eventually(lambda: _running_on_both(workers), 10)
        arm()
        # (structlog's own capture: an earlier test may have sent asyncrl's logs to a console)
        with structlog.testing.capture_logs() as logs:
            # the routed engine took the version (B did): not a failure of the push ...
            assert await group.push([routed], state(2.0), 2) == []
        # ... which names A, and takes it out of the router
        assert group.last_push["missed"] == ["sglang-0"]
        (summary,) = [e for e in logs if e["event"] == "weight_group_push"]
        assert summary["missed"] == ["sglang-0"]
        assert any(e["event"] == "sglang_worker_taken_out" and e.get("engine") == "sglang-0"
                   for e in logs)
        assert not ea.healthy and ea.policy_version == 1
        # B: in a re-formed group of its own, it got version 2 whole
        assert group.members == ["sglang-1"] and group.last_push["attempts"] == 2
        st = await b.state("received", "core.weight_version")
        assert same(st["attrs"]["received"], state(2.0))
        assert eb.policy_version == 2 and st["attrs"]["core.weight_version"] == "2"
        assert [s.name for s in routed.in_service] == ["sglang-1"]
        assert routed.policy_version == 2 and routed.healthy
        # the requests B was serving through the router (round robin: two of four) ran on
        # across the push; A's died with it
        done = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        served = [r[1] for r in done if not isinstance(r, BaseException) and r[0] == "length"]
        assert len(served) == 2, done
        assert all(v[0] == 1 and v[-1] == 2 for v in served)
        await b.set(core__token_delay_s=0.0)
        await eventually(lambda: _listed_is(session, router, {b.url}), 15)
        # requests keep being served through the router, by B, on version 2
        before = len(await b.calls("/generate"))
        for _ in range(4):
            assert await versions_of(routed, 3) == ("length", [2] * 3)
        assert len(await b.calls("/generate")) == before + 4
        # while A is down it is left out of the push, and named
        assert await group.push([routed], state(2.5), 3) == []
        assert group.last_push["missed"] == ["sglang-0"] and routed.policy_version == 3
        # A is back on its port: the next push re-forms the group with both, and puts A back
        port = int(a.url.rsplit(":", 1)[1])
        back = _launch(port).start()
        workers[0] = back
        await warm_up(back)
        await eventually(lambda: ea.healthy, 15)
        assert await group.push([routed], state(3.0), 4) == []
        assert group.members == ["sglang-0", "sglang-1"]
        assert ea.policy_version == eb.policy_version == routed.policy_version == 4
        st = await back.state("received", "core.weight_version")
        assert same(st["attrs"]["received"], state(3.0))
        assert st["attrs"]["core.weight_version"] == "4"
        assert group.last_push["missed"] == []
        assert (await back.calls("/init_weights_update_group"))[0]["world_size"] == 3
        assert [s.name for s in routed.in_service] == ["sglang-0", "sglang-1"]
        assert await listed(session, router) == {back.url, b.url}
        for _ in range(4):  # round robin over both again, every token on version 4
            assert await versions_of(routed, 3) == ("length", [4] * 3)
        assert len(await back.calls("/generate")) >= 1


async def _listed_is(session: aiohttp.ClientSession, router: str, urls: set[str]) -> bool:
    return await listed(session, router) == urls
