"""Weight sync with the `sglang` engine end to end against the fake SGLang server.

The three paths (disk, tensors, a process group: NCCL on a GPU, gloo here) go through the one
update protocol; a server slow to answer its health check while it loads is not declared dead;
and bad answers (the wrong shape, a 4xx/5xx mid-update, a session left open by a crashed
update, a server that stops answering) are each a clear `WeightSyncError` or `EngineError`
with the server's message, never a hang, with the server resumed and the other engines
updated.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
import torch.distributed as dist
from fakes.control import FakeProcess
from fakes.sglang_server import ScriptedModel, tensor_digest

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.router import RoutedSGLangEngine
from asyncrl.engine.sglang.weights import serialize_named_tensors
from asyncrl.errors import EngineError, WeightSyncError
from asyncrl.weightsync.group import _rank0_backend

FAST = RemoteOptions(health_interval_s=0.1, health_timeout_s=1.0, health_failures=2,
                     control_timeout_s=3.0, weight_timeout_s=10.0, load_ttl_s=0.0,
                     startup_timeout_s=10.0, stop_grace_s=2.0)
STATE = {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
         "layer.bias": torch.full((4,), 0.5)}


def req(rid: str = "", n: int = 6) -> GenerateRequest:
    return GenerateRequest(request_id=rid or f"w{id(object())}", input_ids=[11, 12, 13],
                           sampling=SamplingParams(max_new_tokens=n))


def expected(weights: str, n: int = 6) -> list[int]:
    m, ids = ScriptedModel(), []
    for i in range(n):
        ids.append(m.step(weights, [11, 12, 13, *ids], i)[0])
    return ids


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _launch() -> FakeProcess:
    return FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                       "--incremental-streaming-output")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[FakeProcess, FakeProcess]]:
    """Two fake servers, each its own process as a real one is (the tensors cross a process
    boundary): started once for the module, reset before each test."""
    with _launch() as a, _launch() as b:
        yield a, b


@pytest.fixture
async def fake(servers) -> FakeProcess:
    await servers[0].reset()
    return servers[0]


@pytest.fixture
async def fake_b(servers) -> FakeProcess:
    await servers[1].reset()
    return servers[1]


def make(fake: FakeProcess, http: aiohttp.ClientSession, *, tp: int = 1, index: int = 0,
         **opts: Any) -> SGLangEngine:
    return SGLangEngine(SGLangEngineConfig(tp_size=tp), index=index, session=http,
                        url=fake.url, model_path="/fake/model",
                        options=msgspec.structs.replace(FAST, **opts))


# ------------------------------------------------------------- the trainer's gloo side
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GlooTrainer:
    """Rank 0 of the weight-update group, as a trainer process would run it (in threads)."""

    def __init__(self) -> None:
        self.port = _port()
        self.group: Any = None

    def _join(self) -> None:
        # the store prefixes SGLang's own group helper uses (the trainer side of
        # `asyncrl.weightsync.group` builds its backend the same way)
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", self.port, 2, is_master=True, timeout=timeout)
        self.group = _rank0_backend(store, "asyncrl", 2, 30.0, torch.device("cpu"))

    async def join(self) -> None:
        await asyncio.to_thread(self._join)

    async def broadcast(self) -> None:
        def send() -> None:
            for t in STATE.values():
                self.group.broadcast(t, 0).wait()

        await asyncio.to_thread(send)


async def update(eng: SGLangEngine, path: str, version: int, tmp_path: Any) -> None:
    """One update of `path` kind ("disk", "tensor" or "gloo") to `version`."""
    if path == "disk":
        await eng.update_weights(WeightUpdate(version=version, path=str(tmp_path)))
    elif path == "tensor":
        await eng.update_weights(WeightUpdate(version=version, state_dict=STATE))
    else:
        trainer = GlooTrainer()
        await eng.init_weights_update_group(master_address="127.0.0.1",
                                            master_port=trainer.port, rank_offset=1,
                                            world_size=2, backend="gloo", join=trainer.join)
        await eng.update_weights_from_distributed(
            names=list(STATE), dtypes=[str(t.dtype) for t in STATE.values()],
            shapes=[list(t.shape) for t in STATE.values()], version=version,
            broadcast=trainer.broadcast)


def weights_after(path: str, tmp_path: Any) -> str:
    return str(tmp_path) if path == "disk" else tensor_digest(list(STATE.items()))


# ------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("path", ["disk", "tensor", "gloo"])
async def test_each_path_loads_the_weights_and_tags_the_tokens(path, fake, http, tmp_path):
    await fake.set(core__token_delay_s=0.01)
    async with make(fake, http) as eng:
        in_flight = eng.stream(req("flight", 40))
        first = await anext(in_flight)
        await update(eng, path, 4, tmp_path)
        rest = [d async for d in in_flight]
        # the request in flight was retracted, not lost, and finished on the new weights
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
        assert first.policy_version == 0 and rest[-1].policy_version == 4
        g = await collect(eng, req(n=6))
        assert g.token_ids == expected(weights_after(path, tmp_path))
        st = await fake.state("core.weight_version", "received", "session_open")
        assert eng.policy_version == 4 and st["attrs"]["core.weight_version"] == "4"
        if path != "disk":  # the server process holds the very values sent
            got = st["attrs"]["received"]
            assert all(torch.equal(torch.tensor(got[k]), v) for k, v in STATE.items())
        calls = st["calls"]
        sessions = 0 if path == "disk" else 1
        assert len(calls.get("/begin_weight_update", [])) == sessions
        assert len(calls.get("/end_weight_update", [])) == sessions
        assert not st["attrs"]["session_open"]
        assert calls["/pause_generation"] == [{"mode": "retract"}]
        assert len(calls["/continue_generation"]) == 1


@pytest.mark.parametrize("path", ["disk", "tensor", "gloo"])
async def test_a_server_slow_to_answer_health_during_an_update_stays_up(path, fake, http,
                                                                        tmp_path):
    # loading blocks the fake's scheduler for 1.5 s; its /health answers 503 after 0.2 s
    # (SGLang: 20 s); two failed probes would otherwise take the engine down mid-update
    await fake.set(weight_load_delay_s=1.5, health_check_timeout_s=0.2)
    async with make(fake, http) as eng:
        events: list[bool] = []
        eng.on_state = lambda name, up: events.append(up)
        task = asyncio.create_task(update(eng, path, 2, tmp_path))
        await asyncio.sleep(0.5)
        async with http.get(fake.url + "/health") as r:
            assert r.status == 503  # what the supervisor would have seen
        await task
        assert eng.healthy and events == [] and eng.policy_version == 2
        assert len(await fake.calls("/model_info")) >= 3  # liveness probed all along
        # supervision is unchanged outside an update: a blocked server is taken out
        await fake.set(scheduler_free=False)
        async with asyncio.timeout(5):
            while eng.healthy:  # noqa: ASYNC110  (state owned by the supervisor task)
                await asyncio.sleep(0.05)
        assert events == [False]
        await fake.set(scheduler_free=True)


async def test_each_tp_rank_gets_its_own_tensor_payload(fake, http):
    # rank r unpickles element r, its own serialisation of the same tensors
    await fake.set(tp_size=2)
    async with make(fake, http, tp=2) as eng:
        await eng.update_weights(WeightUpdate(version=1, state_dict=STATE))
        assert await fake.attr("core.weights") == tensor_digest(list(STATE.items()))
        sent = (await fake.calls("/update_weights_from_tensor"))[0]
        assert len(sent["serialized_named_tensors"]) == 2
        payload = serialize_named_tensors(list(STATE.items()))
        await http.post(fake.url + "/begin_weight_update", json={})
        async with http.post(fake.url + "/update_weights_from_tensor",
                             json={"serialized_named_tensors": [payload]}) as r:
            assert r.status == 400 and "tp rank 1" in (await r.json())["message"]


async def test_cpu_tensors_sent_by_handle_cannot_be_opened_by_the_server_process(fake, http):
    # torch's own CPU reducer shares a file descriptor through this process's resource
    # sharer, which another process cannot open: SGLang 0.5.23 answers exactly this
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (torch's reducers)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(STATE.items()))
    await http.post(fake.url + "/begin_weight_update", json={})
    body = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()]}
    async with http.post(fake.url + "/update_weights_from_tensor", json=body) as r:
        reply = await r.json()
    assert r.status == 400
    assert reply["message"] == ("Failed to deserialize the tensors of tp rank 0: "
                                "AuthenticationError: digest sent was rejected")
    # asyncrl's payload holds the values themselves: the same tensors open there
    await http.post(fake.url + "/end_weight_update", json={})
    async with make(fake, http) as eng:
        await eng.update_weights(WeightUpdate(version=1, state_dict=STATE))
    assert await fake.attr("core.weights") == tensor_digest(list(STATE.items()))


# ------------------------------------------------------------------------- bad input
async def test_an_update_reply_of_the_wrong_shape_is_a_clear_error(fake, http, tmp_path):
    async with make(fake, http) as eng:
        await fake.reply("/update_weights_from_disk", 200, "OK")
        with pytest.raises(WeightSyncError, match="unexpected reply"):
            await eng.update_weights(WeightUpdate(version=1, path=str(tmp_path)))
        assert eng.policy_version == 0 and eng.healthy
        assert len(await fake.calls("/continue_generation")) == 1  # not left paused
        assert len((await collect(eng, req())).token_ids) == 6


@pytest.mark.parametrize("status", [400, 500])
async def test_a_server_error_mid_update_closes_the_session_and_carries_its_message(
        status, fake, http):
    async with make(fake, http) as eng:
        await fake.reply("/update_weights_from_tensor", status,
                         {"success": False, "message": "CUDA error: out of memory"})
        with pytest.raises(WeightSyncError, match=rf"HTTP {status}: CUDA error: out of memory"):
            await eng.update_weights(WeightUpdate(version=1, state_dict=STATE))
        st = await fake.state("session_open")
        assert not st["attrs"]["session_open"] and len(st["calls"]["/end_weight_update"]) == 1
        assert len(st["calls"]["/continue_generation"]) == 1 and eng.policy_version == 0
        await fake.reply("/update_weights_from_tensor", None)
        await eng.update_weights(WeightUpdate(version=2, state_dict=STATE))  # recovers
        assert eng.policy_version == 2


async def test_a_session_left_open_by_a_crashed_update_is_closed_and_reopened(fake, http):
    async with make(fake, http) as eng:
        await fake.set(session_open=True)  # an earlier trainer died between begin and end
        await eng.update_weights(WeightUpdate(version=3, state_dict=STATE))
        st = await fake.state("session_open")
        assert eng.policy_version == 3 and not st["attrs"]["session_open"]
        assert len(st["calls"]["/begin_weight_update"]) == 2  # refused, then after the end
        assert len(st["calls"]["/end_weight_update"]) == 2
        # a session that cannot be closed is an error, not a hang
        await fake.set(session_open=True)
        await fake.reply("/end_weight_update", 500, {"detail": "scheduler died"})
        async with asyncio.timeout(5):
            with pytest.raises(WeightSyncError, match="scheduler died"):
                await eng.update_weights(WeightUpdate(version=4, state_dict=STATE))
        assert eng.policy_version == 3


async def test_a_server_that_stops_answering_mid_update_is_taken_out_and_the_update_fails(
        fake, http, tmp_path):
    # while loading, /health cannot pass, but /model_info (the HTTP front) still answers; a
    # server that answers nothing is taken out without waiting for the update's deadline
    await fake.set(weight_load_delay_s=60.0, health_check_timeout_s=0.2)
    async with make(fake, http, weight_timeout_s=2.5, health_timeout_s=0.3,
                    control_timeout_s=1.0) as eng:
        task = asyncio.create_task(
            eng.update_weights(WeightUpdate(version=1, path=str(tmp_path))))
        await asyncio.sleep(0.5)
        assert eng.healthy  # loading: health fails, liveness holds
        await fake.set(hang=True)
        async with asyncio.timeout(2.0):
            while eng.healthy:  # noqa: ASYNC110  (state owned by the supervisor task)
                await asyncio.sleep(0.05)
        assert not task.done()
        async with asyncio.timeout(6):
            with pytest.raises(WeightSyncError, match="failed"):
                await task
        assert eng.policy_version == 0
        await fake.set(hang=False)


async def test_bad_nccl_requests_fail_before_or_with_the_servers_reason(fake, http):
    async with make(fake, http) as eng:
        async def noop() -> None:
            return None

        with pytest.raises(WeightSyncError, match="not a torch dtype"):
            await eng.update_weights_from_distributed(names=["w"], dtypes=["float33"],
                                                      shapes=[[2]], version=1, broadcast=noop)
        assert "/pause_generation" not in await fake.calls()  # refused before anything sent
        with pytest.raises(WeightSyncError, match="not initialized"):
            await eng.update_weights_from_distributed(names=["w"], dtypes=["float32"],
                                                      shapes=[[2]], version=1, broadcast=noop,
                                                      group_name="never-joined")
        assert not await fake.attr("session_open") and eng.policy_version == 0

        async def trainer_fails() -> None:
            raise RuntimeError("gloo: connection closed by peer")

        await eng.init_weights_update_group(master_address="127.0.0.1", master_port=1,
                                            rank_offset=1, world_size=2)
        with pytest.raises(WeightSyncError, match=r"trainer side .* connection closed"):
            await eng.update_weights_from_distributed(names=["w"], dtypes=["float32"],
                                                      shapes=[[2]], version=1,
                                                      broadcast=trainer_fails)
        assert not await fake.attr("session_open") and eng.policy_version == 0


async def test_load_of_the_wrong_shape_is_an_engine_error(fake, http):
    async with make(fake, http) as eng:
        await fake.reply("/v1/loads", 200, {"loads": "busy"})
        with pytest.raises(EngineError, match="unrecognised /v1/loads"):
            await eng.load()
        assert eng.healthy


async def test_one_engines_failed_update_leaves_the_others_updated(fake, fake_b, http,
                                                                   tmp_path):
    from asyncrl.weightsync.push import push_weights

    trainer = SimpleNamespace(state_dict_for_sync=lambda: STATE)
    a, b = fake, fake_b
    ea, eb = make(a, http), make(b, http, index=1)
    async with ea, eb:
        await a.reply("/update_weights_from_tensor", 500, {"detail": "boom"})
        await push_weights([ea, eb], trainer, 5, "tensor", tmp_path)  # the run goes on
        assert (ea.policy_version, eb.policy_version) == (0, 5)
        assert {d.policy_version async for d in eb.stream(req())} == {5}
        assert {d.policy_version async for d in ea.stream(req())} == {0}
        # behind a router each server counts: a failed one is taken out, the rest go on
        routed = RoutedSGLangEngine(b.url, [ea, eb])
        await routed.update_weights(WeightUpdate(version=6, state_dict=STATE))
        assert eb.policy_version == 6 and routed.policy_version == 6
        assert [s.name for s in routed.in_service] == ["sglang-1"]
        await b.reply("/update_weights_from_tensor", 500, {"detail": "boom"})
        with pytest.raises(WeightSyncError, match=r"sglang-1.*boom"):  # none took them
            await routed.update_weights(WeightUpdate(version=7, state_dict=STATE))
        with pytest.raises(WeightSyncError):  # no engine took them: that is the run's end
            await push_weights([ea, eb], trainer, 7, "tensor", tmp_path)


async def test_disk_sync_exports_each_version_and_keeps_only_the_newest(fake, fake_b, http,
                                                                         tmp_path):
    """`engine.weight_sync = "disk"`: the train loop exports an HF directory per version under
    the run directory, every server loads that path, and the previous version's is removed."""
    from asyncrl.weightsync.push import push_weights

    exported: list[str] = []

    def export_hf(path) -> None:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"weights")
        exported.append(str(path))

    a, b = fake, fake_b
    ea, eb = make(a, http), make(b, http, index=1)
    async with ea, eb:
        trainer = SimpleNamespace(export_hf=export_hf)
        await push_weights([ea, eb], trainer, 1, "disk", tmp_path)
        await push_weights([ea, eb], trainer, 2, "disk", tmp_path)
        assert (ea.policy_version, eb.policy_version) == (2, 2)
    assert exported == [str(tmp_path / "weights" / "v1"), str(tmp_path / "weights" / "v2")]
    for f in (a, b):
        assert [c["model_path"] for c in await f.calls("/update_weights_from_disk")] == exported
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2"]
