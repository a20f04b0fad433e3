"""The distributed weight sync end to end: trainer rank 0 here (`WeightGroup`), the fake SGLang
server as its own process joining a real gloo group as the real server does
(`init_custom_process_group`'s store prefixes, torch's own group helper).

- loopback: several buckets, one `/update_weights_from_distributed` call each inside one
  session; the server holds exactly the trainer's tensors and the version;
- a server killed mid-broadcast: the push ends within the group's timeout naming it, the
  group is re-formed with the server left and it gets the version; the killed server, back
  on its port, is in the group again at a later push;
- `push_weights` through the "distributed" mode, and what it refuses.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import traceback
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
from fakes.control import FakeProcess
from remote_helpers import FAST, eventually, kill_at_broadcast, warm_up

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.errors import WeightSyncError
from asyncrl.weightsync.group import WeightGroup
from asyncrl.weightsync.push import push_weights

OPTS = msgspec.structs.replace(FAST, weight_timeout_s=6.0, health_interval_s=0.1)
"""The group's timeout is half of `weight_timeout_s`: 3 s."""


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(64, 32, generator=g),         # 8 KiB
            "layer.0.weight": torch.randn(32, 32, generator=g),       # 4 KiB
            "layer.0.bias": torch.randn(32, generator=g),
            "layer.1.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(32)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(port: int = 0) -> FakeProcess:
    extra = ["--port", str(port)] if port else []
    return FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                       "--incremental-streaming-output", *extra)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[FakeProcess]]:
    ports = [_free_port(), _free_port()]
    fakes = [_launch(p).start() for p in ports]
    try:
        for f in fakes:
            asyncio.run(warm_up(f))
        yield fakes
    finally:
        for f in fakes:
            f.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def make(fake: FakeProcess, http: aiohttp.ClientSession, index: int) -> SGLangEngine:
    return SGLangEngine(SGLangEngineConfig(weight_sync="distributed"), index=index,
                        session=http, url=fake.url, model_path="/fake/model", options=OPTS)


async def received(fake: FakeProcess) -> dict[str, Any]:
    st = await fake.state("received", "core.weight_version", "session_open")
    return st


def busy_threads() -> list[str]:
    """Threads still inside the group's worker functions."""
    names = {"_send_bucket", "_rank0_backend", "_master_store"}
    return [str(tid) for tid, frame in sys._current_frames().items()
            if any(f.f_code.co_name in names for f, _ in traceback.walk_stack(frame))]


def same(got: dict[str, Any], sent: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(sent) and all(
        torch.equal(torch.tensor(got[k], dtype=v.dtype), v) for k, v in sent.items())


async def test_loopback_push_in_buckets_lands_exactly(servers, http):
    fake = servers[0]
    await fake.reset()
    sent = state()
    async with make(fake, http, 0) as eng, WeightGroup(bucket_bytes=6 << 10) as group:
        assert await group.push([eng], sent, 3) == []
        assert group.members == ["sglang-0"] and eng.policy_version == 3
        st = await received(fake)
        assert same(st["attrs"]["received"], sent)
        assert st["attrs"]["core.weight_version"] == "3" and not st["attrs"]["session_open"]
        calls = st["calls"]
        init = calls["/init_weights_update_group"]
        assert len(init) == 1 and init[0]["world_size"] == 2 and init[0]["rank_offset"] == 1
        assert init[0]["backend"] == "gloo" and init[0]["master_address"] == "127.0.0.1"
        bodies = calls["/update_weights_from_distributed"]
        assert len(bodies) == group.last_push["buckets"] == 3  # 8 KiB alone, then <= 6 KiB
        assert [b["flush_cache"] for b in bodies] == [False, False, True]
        assert [b.get("weight_version") for b in bodies] == [None, None, "3"]
        assert [n for b in bodies for n in b["names"]] == list(sent)
        assert "bfloat16" in bodies[2]["dtypes"]
        assert len(calls["/begin_weight_update"]) == len(calls["/end_weight_update"]) == 1
        # a second push reuses the group
        sent2 = {k: v + 1 for k, v in sent.items()}
        assert await group.push([eng], sent2, 4) == []
        st = await received(fake)
        assert same(st["attrs"]["received"], sent2) and eng.policy_version == 4
        assert len(st["calls"]["/init_weights_update_group"]) == 1
    # the end of the run: the server was asked to leave the group
    assert (await fake.calls("/destroy_weights_update_group")) == [
        {"group_name": f"{group.name}-1"}]


async def test_a_restarted_trainer_forms_a_new_group_beside_the_one_its_dead_run_left(
        servers, http):
    """F16: a trainer killed without closing its group leaves it on the server (real SGLang
    keeps a group until it is destroyed, and refuses a second group of the same name). The
    next trainer process must not ask for that name: its first push lands at once."""
    fake = servers[0]
    await fake.reset()
    sent = state()
    async with make(fake, http, 0) as eng:
        dead = WeightGroup()  # the killed trainer: its group is never closed nor left
        try:
            assert await dead.push([eng], sent, 1) == []
            fresh = WeightGroup()  # the restarted trainer, a new process
            async with fresh:
                t0 = time.monotonic()
                assert await fresh.push([eng], {k: v + 1 for k, v in sent.items()}, 2) == []
                assert time.monotonic() - t0 < OPTS.weight_timeout_s / 2  # no join timed out
                assert fresh.last_push["attempts"] == 1 and eng.policy_version == 2
            names = [c["group_name"] for c in await fake.calls("/init_weights_update_group")]
            assert len(set(names)) == 2, names
        finally:
            await dead.close()


async def test_a_server_killed_mid_broadcast_is_named_and_the_rest_still_updated(
        servers, http, monkeypatch):
    for f in servers:
        await f.reset()
    a, b = servers
    sent = state()
    arm = kill_at_broadcast(monkeypatch, a)  # A dies at bucket 2 of the armed push
    async with make(a, http, 0) as ea, make(b, http, 1) as eb, \
            WeightGroup(bucket_bytes=6 << 10) as group:
        assert await group.push([ea, eb], sent, 1) == []
        arm()
        t0 = time.monotonic()
        failed = await group.push([ea, eb], {k: v * 2 for k, v in sent.items()}, 2)
        took = time.monotonic() - t0
        # A is named; the push took about the group's timeout (3 s), under the servers' 6 s
        assert [n for n, _ in failed] == ["sglang-0"] and took < OPTS.weight_timeout_s
        assert "sglang-0" in str(failed[0][1])
        assert not ea.healthy and ea.policy_version == 1
        # B: in a new group of its own, it got version 2 whole
        assert group.members == ["sglang-1"] and group.last_push["attempts"] == 2
        st = await received(b)
        assert same(st["attrs"]["received"], {k: v * 2 for k, v in sent.items()})
        assert eb.policy_version == 2 and st["attrs"]["core.weight_version"] == "2"
        assert [c["group_name"] for c in st["calls"]["/init_weights_update_group"]] == [
            f"{group.name}-1", f"{group.name}-2"]
        assert {"group_name": f"{group.name}-1"} in st["calls"]["/destroy_weights_update_group"]
        assert busy_threads() == []  # no broadcast or join left running
        # the next push goes to B over the same group; A is left out, named as down
        failed = await group.push([ea, eb], sent, 3)
        assert [n for n, _ in failed] == ["sglang-0"] and "down" in str(failed[0][1])
        assert eb.policy_version == 3 and group.members == ["sglang-1"]
        # A comes back on its port: the push after that re-forms the group with both
        assert a.url
        port = int(a.url.rsplit(":", 1)[1])
        back = _launch(port).start()
        servers[0] = back
        await warm_up(back)
        await eventually(lambda: ea.healthy, 15)
        assert await group.push([ea, eb], sent, 4) == []
        assert group.members == ["sglang-0", "sglang-1"]
        assert ea.policy_version == eb.policy_version == 4
        assert same((await received(back))["attrs"]["received"], sent)
        assert (await back.calls("/init_weights_update_group"))[0]["world_size"] == 3


async def test_push_weights_drives_the_group_and_refuses_without_one(servers, http, tmp_path):
    fake = servers[1]
    await fake.reset()
    sent = state()

    class Trainer:
        model = None

        def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
            return sent

    async with make(fake, http, 0) as eng, WeightGroup() as group:
        update = await push_weights([eng], Trainer(), 5, "distributed", tmp_path,  # type: ignore[arg-type]
                                    group=group)
        assert update.version == 5 and eng.policy_version == 5
        assert same((await received(fake))["attrs"]["received"], sent)
        with pytest.raises(WeightSyncError, match="needs the run's weight-update group"):
            await push_weights([eng], Trainer(), 6, "distributed", tmp_path)  # type: ignore[arg-type]
        # every engine failing is the push failing, naming it
        await fake.reply("/update_weights_from_distributed", 500, {"message": "boom"})
        with pytest.raises(WeightSyncError, match="sglang-0"):
            await asyncio.wait_for(push_weights([eng], Trainer(), 7, "distributed",  # type: ignore[arg-type]
                                                tmp_path, group=group), 10)
        assert eng.policy_version == 5
        await fake.reply("/update_weights_from_distributed", None)
