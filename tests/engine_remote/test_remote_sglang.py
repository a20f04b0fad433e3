"""The `sglang` engine against the fake SGLang server, and behind the fake sglang-router, each
running as a process of its own as the real ones do: one server for the module (and the
router with its two workers), reset before each test (`fakes.control`); a test that crashes
a server, or brings one back on the same address, launches its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
from fakes.control import FakeProcess
from fakes.scripted_core import ScriptedModel
from fakes.sglang_server import tensor_digest
from remote_helpers import FAST, eventually, make_request

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import Engine, WeightUpdate, collect
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.router import RoutedSGLangEngine
from asyncrl.errors import EngineUnavailable, WeightSyncError

CFG = SGLangEngineConfig(request_timeout_s=30.0)


def launch(*args: str, port: int = 0) -> FakeProcess:
    return FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                       "--incremental-streaming-output", *args, port=port)


@pytest.fixture(scope="module")
def server() -> Iterator[FakeProcess]:
    with launch() as fake:
        yield fake


@pytest.fixture
async def fake(server) -> FakeProcess:
    await server.reset()
    return server


def engine(fake: FakeProcess, session, options=FAST, **kw) -> SGLangEngine:
    return SGLangEngine(CFG, index=0, session=session, url=fake.url, options=options, **kw)


PATIENT = msgspec.structs.replace(FAST, health_interval_s=600.0, health_timeout_s=600.0,
                                  control_timeout_s=600.0, weight_timeout_s=600.0)
"""For a test that asserts what an update sends, not how fast the server answers: the fake's
first tensor load imports torch in its process, which on a loaded machine outlasts FAST's
deadlines and its health probes; with these the test waits on the server's replies alone."""


def expected(weights: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    m, ids, lps = ScriptedModel(), [], []
    for i in range(n):
        t, lp = m.step(weights, prompt + ids, i)
        ids.append(t)
        lps.append(lp)
    return ids, lps


@pytest.mark.parametrize("incremental", [True, False])
async def test_streams_token_ids_and_logprobs(fake, session, incremental):
    await fake.set(incremental=incremental)
    async with engine(fake, session) as eng:
        assert isinstance(eng, Engine)
        deltas = [d async for d in eng.stream(make_request([11, 12, 13], max_new=6))]
        ids = [t for d in deltas for t in d.token_ids]
        lps = [x for d in deltas for x in d.logprobs]
        assert (ids, lps) == expected("/fake/model", [11, 12, 13], 6)
        assert len(deltas) == 6  # one event per token, streamed as they come
        assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
        assert eng.capacity == 4096


async def test_stop_token_is_kept_and_ends_the_stream(fake, session):
    await fake.set(core__model__script=[20, 21, 7, 22, 23])
    async with engine(fake, session) as eng:
        g = await collect(eng, make_request(max_new=10, stop_ids=(7,)))
        assert g.token_ids == [20, 21, 7] and g.finish_reason == "stop"
        assert (await fake.calls("/generate"))[0]["sampling_params"]["stop_token_ids"] == [7]


async def test_stop_string_keeps_the_closing_tag(fake, session):
    vocab = {20: "<tool_call>", 21: '{"code": 1}', 22: "</tool_", 23: "call>", 24: "after"}
    await fake.set(core__model__script=[20, 21, 22, 23, 24],
                   core__vocab={str(i): text for i, text in vocab.items()})
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    async with engine(fake, session) as eng:
        g = await collect(eng, make_request(max_new=10, stop_strs=("</tool_call>",)))
        # The tag spans two tokens; both are in the output, nothing after it.
        assert g.token_ids == [20, 21, 22, 23] and g.finish_reason == "stop"
        assert decode(g.token_ids).endswith("</tool_call>")
        assert (await fake.calls("/generate"))[0]["sampling_params"]["no_stop_trim"] is True


async def test_abort_ends_the_stream_and_frees_the_server(fake, session):
    await fake.set(core__token_delay_s=0.02)
    async with engine(fake, session) as eng:
        req = make_request(max_new=1000, rid="to-abort")
        got = []

        async def consume():
            async for d in eng.stream(req):
                got.append(d)
                if len(got) == 3:
                    await eng.abort("to-abort")
                    await asyncio.sleep(0.2)  # tokens keep arriving meanwhile

        async with asyncio.timeout(5):
            await consume()
        assert got[-1].finish_reason == "abort" and len(got) == 4  # nothing after abort()
        assert sum(len(d.token_ids) for d in got) == 3
        assert await fake.calls("/abort_request") == [{"rid": "to-abort#"}]  # see wire_rid
        await asyncio.sleep(0.1)
        assert await fake.attr("core.running") == {}


async def test_load_reports_running_requests_and_kv_and_is_cached(fake, session):
    await fake.set(core__token_delay_s=0.05, core__capacity=1000)
    async with engine(fake, session) as eng:
        idle = await eng.load()
        assert (idle.kv_tokens_used, idle.kv_tokens_capacity, idle.running) == (0, 1000, 0)
        tasks = [asyncio.create_task(collect(eng, make_request([11] * 10, max_new=40)))
                 for _ in range(2)]
        try:
            await asyncio.sleep(0.3)
            await asyncio.sleep(FAST.load_ttl_s)
            busy = await eng.load()
            assert busy.running == 2 and busy.waiting == 0
            assert 2 * 10 <= busy.kv_tokens_used < 2 * 50  # prompts + tokens so far
            assert busy.kv_free == 1000 - busy.kv_tokens_used
            n = len(await fake.calls())  # no request recorded for /metrics; count via a second read
            cached = await eng.load()  # within the TTL: the cached scrape, a little older
            assert (cached.kv_tokens_used, cached.running) == (busy.kv_tokens_used, busy.running)
            assert cached.age_s >= busy.age_s
            assert len(await fake.calls()) == n
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_load_numbers_lag_like_the_servers_and_carry_their_age(fake, session):
    # /v1/loads is a snapshot the server republishes every few decode steps: between two,
    # the numbers stand still and the report says how old they are
    await fake.set(core__token_delay_s=0.03)
    async with engine(fake, session) as eng:
        task = asyncio.create_task(collect(eng, make_request([11] * 10, max_new=200)))

        async def sixteen_generated() -> bool:
            return await fake.attr("core.tokens_generated") >= 16

        try:
            await eventually(sixteen_generated, 5)
            first = await eng.load()
            await asyncio.sleep(FAST.load_ttl_s + 0.1)
            second = await eng.load()
            assert second.running == 1 and second.kv_tokens_used >= 10
            assert second.age_s >= 0.0
            cached = await eng.load()  # within the TTL: same numbers, older
            assert cached.kv_tokens_used == second.kv_tokens_used
            assert cached.age_s >= second.age_s
            assert first.kv_tokens_capacity == 4096
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_disk_update_pauses_flushes_resumes_and_changes_outputs(fake, session, tmp_path):
    async with engine(fake, session, model_path="/fake/model") as eng:
        before = await collect(eng, make_request(max_new=8))
        await eng.update_weights(WeightUpdate(version=3, path=str(tmp_path)))
        assert eng.policy_version == 3
        calls = await fake.calls()
        assert calls["/pause_generation"] == [{"mode": "retract"}]
        assert calls["/update_weights_from_disk"] == [
            {"model_path": str(tmp_path), "weight_version": "3", "flush_cache": True,
             "abort_all_requests": False}]  # the update flushes; no separate /flush_cache
        assert len(calls["/continue_generation"]) == 1
        assert "/begin_weight_update" not in calls  # the disk path needs no session
        deltas = [d async for d in eng.stream(make_request(max_new=8))]
        after = [t for d in deltas for t in d.token_ids]
        assert after != before.token_ids
        assert after == expected(str(tmp_path), [11, 12, 13], 8)[0]
        assert {d.policy_version for d in deltas} == {3}


async def test_failed_update_keeps_version_and_resumes(fake, session):
    async with engine(fake, session) as eng:
        with pytest.raises(WeightSyncError, match="not found"):
            await eng.update_weights(WeightUpdate(version=1, path="/no/such/dir"))
        assert eng.policy_version == 0
        assert len(await fake.calls("/continue_generation")) == 1  # never left paused
        assert (await collect(eng, make_request(max_new=2))).finish_reason == "length"


async def test_in_flight_request_survives_an_update_and_finishes_on_new_weights(fake, session,
                                                                                 tmp_path):
    await fake.set(core__token_delay_s=0.02)
    async with engine(fake, session) as eng:
        stream = eng.stream(make_request(max_new=30))
        first = await anext(stream)
        assert first.policy_version == 0
        await eng.update_weights(WeightUpdate(version=1, path=str(tmp_path)))
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "length" and rest[-1].policy_version == 1
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 30


async def test_server_without_pause_support_still_updates(fake, session, tmp_path):
    async with engine(fake, session) as eng:
        await fake.reply("/pause_generation", 404, {"detail": "Not Found"})  # an old server
        await eng.update_weights(WeightUpdate(version=2, path=str(tmp_path)))
        await eng.update_weights(WeightUpdate(version=3, path=str(tmp_path)))
        assert eng.policy_version == 3
        assert len(await fake.calls("/update_weights_from_disk")) == 2


async def test_tensor_update_sends_named_tensors_in_buckets_inside_a_session(fake, session,
                                                                           monkeypatch):
    import torch

    from asyncrl.engine.sglang import weights as sglang_weights

    monkeypatch.setattr(sglang_weights, "TENSOR_BUCKET_BYTES", 80)  # 64 + 16 fit, 64 + 64 not
    state = {"a.weight": torch.ones(4, 4), "b.weight": torch.zeros(4, 4), "c.bias": torch.ones(4)}
    async with engine(fake, session, PATIENT) as eng:
        await eng.update_weights(WeightUpdate(version=5, state_dict=state))
        calls = await fake.calls()
        sent = calls["/update_weights_from_tensor"]
        assert [c["names"] for c in sent] == [["a.weight"], ["b.weight", "c.bias"]]
        assert [c["flush_cache"] for c in sent] == [False, True]
        assert sent[-1]["weight_version"] == "5" and eng.policy_version == 5
        assert len(calls["/begin_weight_update"]) == 1
        assert len(calls["/end_weight_update"]) == 1
        assert not await fake.attr("session_open")
        assert await fake.attr("core.weights") == tensor_digest(list(state.items()))


async def test_a_tensor_update_of_several_megabytes_crosses_the_process_boundary(fake, session):
    """One bucket is one request body (512 MiB by default): the server takes it whole."""
    import torch

    state = {"big.weight": torch.arange(3 << 18, dtype=torch.float32)}  # 3 MiB
    async with engine(fake, session) as eng:
        await eng.update_weights(WeightUpdate(version=2, state_dict=state))
        assert eng.policy_version == 2
        assert await fake.attr("core.weights") == tensor_digest(list(state.items()))


async def test_nccl_update_runs_server_receive_and_trainer_broadcast_together(fake, session):
    async with engine(fake, session) as eng:
        joined, sent = asyncio.Event(), asyncio.Event()

        async def join():
            joined.set()

        async def broadcast():
            sent.set()

        await eng.init_weights_update_group(master_address="10.0.0.1", master_port=29500,
                                            rank_offset=1, world_size=2, join=join)
        await eng.update_weights_from_distributed(names=["w"], dtypes=["torch.bfloat16"],
                                                  shapes=[[2, 2]], version=7, broadcast=broadcast)
        assert joined.is_set() and sent.is_set() and eng.policy_version == 7
        calls = await fake.calls()
        assert calls["/init_weights_update_group"][0]["rank_offset"] == 1
        body = calls["/update_weights_from_distributed"][0]
        assert body["names"] == ["w"] and body["weight_version"] == "7"
        assert body["dtypes"] == ["bfloat16"]
        assert len(calls["/begin_weight_update"]) == 1 and not await fake.attr("session_open")


async def test_server_dying_mid_stream_raises_unavailable_and_marks_down(session):
    """The server process is killed mid-stream (its own process: the module's stays up)."""
    with launch("--fake-token-delay", "0.02") as fake:
        async with engine(fake, session) as eng:
            events = []
            eng.on_state = lambda name, up: events.append((name, up))
            stream = eng.stream(make_request(max_new=500))
            await anext(stream)
            fake.stop()
            with pytest.raises(EngineUnavailable):
                async with asyncio.timeout(5):
                    async for _ in stream:
                        pass
            await eventually(lambda: not eng.healthy, 5)
            assert events == [("sglang-0", False)]
            with pytest.raises(EngineUnavailable, match="down"):
                await eng.load()
            with pytest.raises(EngineUnavailable, match="down"):
                await collect(eng, make_request())


async def test_a_refused_connection_is_unavailable_and_marks_down():
    import aiohttp

    # no kept-alive connection to fail on: the request itself finds nobody listening
    with launch() as fake:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as s, engine(fake, s) as eng:
            fake.stop()
            assert eng.healthy  # no probe since: the request is the first to find out
            with pytest.raises(EngineUnavailable, match="unreachable"):
                await collect(eng, make_request())
            assert not eng.healthy


async def test_silent_server_is_marked_down_and_its_streams_cut(fake, session):
    await fake.set(core__token_delay_s=0.02)
    async with engine(fake, session) as eng:
        stream = eng.stream(make_request(max_new=500))
        await anext(stream)
        # stops sending tokens and answering probes, keeps sockets open
        await fake.set(hang=True)
        with pytest.raises(EngineUnavailable, match="went down"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert not eng.healthy
        await fake.set(hang=False)


async def test_attached_server_that_returns_is_used_again_with_the_latest_weights(session,
                                                                                tmp_path):
    with launch() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        async with engine(fake, session, model_path="/fake/model") as eng:
            events = []
            eng.on_state = lambda name, up: events.append(up)
            await eng.update_weights(WeightUpdate(version=4, path=str(tmp_path)))
            fake.stop()
            await eventually(lambda: not eng.healthy, 5)
            # a fresh server process on the same address, with the base weights
            with launch(port=port) as back:
                await eventually(lambda: eng.healthy, 10)
                assert events == [False, True]
                calls = await back.calls("/update_weights_from_disk")
                assert calls[0]["model_path"] == str(tmp_path)
                g = await collect(eng, make_request(max_new=4))
                assert g.token_ids == expected(str(tmp_path), [11, 12, 13], 4)[0]
                assert eng.policy_version == 4


@pytest.fixture(scope="module")
def routed_fleet() -> Iterator[tuple[FakeProcess, FakeProcess, FakeProcess]]:
    """Two fake SGLang workers (KV capacity 1000 and 3000) and a fake router, each a process."""
    def worker(capacity: int) -> FakeProcess:
        return FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                           "--incremental-streaming-output", "--fake-capacity", str(capacity))

    with worker(1000) as a, worker(3000) as b, FakeProcess("sglang_router.py") as router:
        yield a, b, router


@pytest.fixture
async def fleet(routed_fleet) -> tuple[FakeProcess, FakeProcess, FakeProcess]:
    for fake in routed_fleet:
        await fake.reset()
    return routed_fleet


async def test_router_engine_registers_workers_sums_load_and_fans_out(fleet, session, tmp_path):
    a, b, router = fleet
    ea = SGLangEngine(CFG, index=0, session=session, url=a.url, options=FAST)
    eb = SGLangEngine(CFG, index=1, session=session, url=b.url, options=FAST)
    async with RoutedSGLangEngine(router.url, [ea, eb], register=True) as routed:
        assert isinstance(routed, Engine)
        # registered through POST /workers (202) and seen healthy in GET /workers
        assert await router.calls("POST /workers") == [{"url": a.url}, {"url": b.url}]
        assert all(w["is_healthy"] for w in (await router.attr("workers")).values())
        assert (await routed.load()).kv_tokens_capacity == 4000
        g = await collect(routed, make_request(max_new=3))
        assert len(g.token_ids) == 3 and len(await router.calls("/generate")) == 1
        await routed.abort("x")
        assert await a.calls("/abort_request") == await b.calls("/abort_request") == [
            {"rid": "x#"}]
        await routed.update_weights(WeightUpdate(version=2, path=str(tmp_path)))
        assert routed.policy_version == 2


async def test_a_worker_failing_its_update_is_taken_out_of_the_router_and_put_back(
        fleet, session, tmp_path):
    a, b, router = fleet
    ea = SGLangEngine(CFG, index=0, session=session, url=a.url, options=FAST)
    eb = SGLangEngine(CFG, index=1, session=session, url=b.url, options=FAST)
    async with RoutedSGLangEngine(router.url, [ea, eb], register=True) as routed:
        await a.reply("/update_weights_from_disk", 500, {"detail": "boom"})
        await routed.update_weights(WeightUpdate(version=1, path=str(tmp_path)))
        assert set(await router.attr("workers")) == {b.url} and routed.policy_version == 1
        assert [s.name for s in routed.in_service] == ["sglang-1"]
        await a.reply("/update_weights_from_disk", None)
        await routed.update_weights(WeightUpdate(version=2, path=str(tmp_path)))
        assert set(await router.attr("workers")) == {a.url, b.url}
        assert routed.policy_version == 2


async def test_registry_builds_engines_that_open_their_own_session(fake, tmp_path):
    from asyncrl.engine import build_engines
    from asyncrl.errors import ConfigError

    engines = build_engines(SGLangEngineConfig(urls=[fake.url]), model_path="/fake/model",
                            run_dir=tmp_path, remote_options=FAST)
    assert [type(e) for e in engines] == [SGLangEngine]
    async with engines[0] as eng:
        assert len((await collect(eng, make_request(max_new=3))).token_ids) == 3
    assert eng.session.closed
    with pytest.raises(ConfigError, match=r"model\.path"):
        build_engines(SGLangEngineConfig(), model_path="")
