"""The `vllm` engine against the fake vLLM server, running as its own process as a real one
does: one for the module, reset before each test (`fakes.control`), and one launched for
runtime LoRA updating (`--enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING) for the adapter
tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fakes.control import FakeProcess
from fakes.scripted_core import ScriptedModel
from remote_helpers import FAST, eventually, make_request

from asyncrl.config import VLLMEngineConfig
from asyncrl.engine.base import Engine, WeightUpdate, collect
from asyncrl.engine.vllm.engine import VLLMEngine
from asyncrl.errors import EngineUnavailable, WeightSyncError

CFG = VLLMEngineConfig(request_timeout_s=30.0)


def _launch() -> FakeProcess:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING (whatever the caller's environment holds)."""
    return FakeProcess("vllm_server.py", "--model", "/fake/model",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})


@pytest.fixture(scope="module")
def server() -> Iterator[FakeProcess]:
    with _launch() as fake:
        yield fake


@pytest.fixture
async def fake(server) -> FakeProcess:
    await server.reset()
    return server


@pytest.fixture(scope="module")
def lora_server() -> Iterator[FakeProcess]:
    with FakeProcess("vllm_server.py", "--model", "/fake/model", "--enable-lora",
                     "--max-lora-rank", "8",
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as fake:
        yield fake


@pytest.fixture
async def lora_fake(lora_server) -> FakeProcess:
    await lora_server.reset()
    return lora_server


def engine(fake: FakeProcess, session) -> VLLMEngine:
    return VLLMEngine(CFG, index=0, session=session, url=fake.url, options=FAST)


async def test_streams_deltas_with_logprobs(fake, session):
    async with engine(fake, session) as eng:
        assert isinstance(eng, Engine)
        deltas = [d async for d in eng.stream(make_request([11, 12], max_new=5))]
        assert len(deltas) == 5 and deltas[-1].finish_reason == "length"
        m, ids = ScriptedModel(), []
        for i in range(5):
            ids.append(m.step("/fake/model", [11, 12, *ids], i)[0])
        assert [t for d in deltas for t in d.token_ids] == ids
        assert all(lp < 0 for d in deltas for lp in d.logprobs)
        body = (await fake.calls("/v1/completions"))[0]
        assert body["model"] == "asyncrl" and body["prompt"] == [11, 12]


async def test_stop_string_is_included(fake, session):
    await fake.set(core__vocab={"20": "a", "21": "</tool_", "22": "call>", "23": "b"},
                   core__model__script=[20, 21, 22, 23])
    async with engine(fake, session) as eng:
        g = await collect(eng, make_request(max_new=10, stop_strs=("</tool_call>",)))
        assert g.token_ids == [20, 21, 22] and g.finish_reason == "stop"
        assert (await fake.calls("/v1/completions"))[0]["include_stop_str_in_output"] is True


async def test_abort_uses_the_engine_request_id(fake, session):
    await fake.set(core__token_delay_s=0.02)
    async with engine(fake, session) as eng:
        got = []
        async with asyncio.timeout(5):
            async for d in eng.stream(make_request(max_new=1000, rid="ab")):
                got.append(d)
                if len(got) == 2:
                    await eng.abort("ab")
        assert got[-1].finish_reason == "abort"
        assert await fake.calls("/abort_requests") == [{"request_ids": ["cmpl-ab-0"]}]


async def test_load_from_prometheus(fake, session):
    await fake.set(core__capacity=2048, core__token_delay_s=0.05)
    async with engine(fake, session) as eng:
        assert eng.capacity == 2048
        task = asyncio.create_task(collect(eng, make_request([11] * 100, max_new=50)))
        try:
            await asyncio.sleep(0.4)
            load = await eng.load()
            assert load.kv_tokens_capacity == 2048 and load.running == 1
            assert 100 < load.kv_tokens_used < 160
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_disk_update_sequence(fake, session, tmp_path):
    async with engine(fake, session) as eng:
        before = await collect(eng, make_request(max_new=6))
        await eng.update_weights(WeightUpdate(version=9, path=str(tmp_path)))
        calls = await fake.calls()
        assert calls["/pause"] == [{"mode": "keep"}]
        assert calls["/collective_rpc"] == [
            {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}]
        assert calls["/reset_prefix_cache"] == [{"reset_running_requests": "true"}]
        assert len(calls["/resume"]) == 1
        assert await fake.attr("core.weight_version") == "9" and eng.policy_version == 9
        after = await collect(eng, make_request(max_new=6))
        assert after.token_ids != before.token_ids
        with pytest.raises(WeightSyncError, match="disk only"):
            await eng.update_weights(WeightUpdate(version=10, state_dict={}))
        assert eng.policy_version == 9 and len(await fake.calls("/resume")) == 2


async def test_a_failed_reload_is_a_weight_sync_error_and_the_server_resumes(fake, session,
                                                                              tmp_path):
    await fake.reply("/collective_rpc", 500, {"detail": "reload_weights failed"})
    async with engine(fake, session) as eng:
        with pytest.raises(WeightSyncError, match="reload_weights failed"):
            await eng.update_weights(WeightUpdate(version=3, path=str(tmp_path)))
        assert eng.policy_version == 0 and len(await fake.calls("/resume")) == 1
        assert len((await collect(eng, make_request(max_new=4))).token_ids) == 4


async def test_dead_server(session):
    """The server process is killed mid-stream (its own process: the module's stays up)."""
    with FakeProcess("vllm_server.py", "--fake-token-delay", "0.02") as fake:
        async with engine(fake, session) as eng:
            stream = eng.stream(make_request(max_new=500))
            await anext(stream)
            fake.stop()
            with pytest.raises(EngineUnavailable):
                async with asyncio.timeout(5):
                    async for _ in stream:
                        pass
            await eventually(lambda: not eng.healthy, 5)


async def test_tied_embeddings_are_not_reloaded_in_place_on_an_attached_server(fake, session,
                                                                               tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "tie_word_embeddings": true}')
    async with engine(fake, session) as eng:
        with pytest.raises(WeightSyncError, match="ties its word embeddings"):
            await eng.update_weights(WeightUpdate(version=1, path=str(tmp_path)))
        assert await fake.calls("/collective_rpc") == [] and eng.policy_version == 0


def _adapter(path, rank: int = 4) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(f'{{"r": {rank}, "peft_type": "LORA"}}')
    return str(path)


async def test_lora_adapters_load_by_name_and_serve_their_requests(lora_fake, session, tmp_path):
    """The base once, then each version's adapter by /v1/load_lora_adapter; requests name the
    newest as their model and carry its version; older ones than the previous are unloaded."""
    fake = lora_fake
    async with engine(fake, session) as eng:
        base = str(tmp_path / "base")
        (tmp_path / "base").mkdir()
        paths = [_adapter(tmp_path / f"a{v}") for v in (1, 2, 3)]
        await eng.update_weights(WeightUpdate(version=1, path=base, adapter_path=paths[0]))
        for v in (2, 3):
            await eng.update_weights(WeightUpdate(version=v, adapter_path=paths[v - 1],
                                                  base_version=1))
        deltas = [d async for d in eng.stream(make_request([11, 12], max_new=4))]
        m, ids = ScriptedModel(), []
        for i in range(4):
            ids.append(m.step(f"{base}+lora:{paths[2]}", [11, 12, *ids], i)[0])
        assert [t for d in deltas for t in d.token_ids] == ids
        assert {d.policy_version for d in deltas} == {3}
        assert await fake.attr("core.weight_version") == "1"
        calls = await fake.calls()
        assert calls["/v1/completions"][-1]["model"] == "asyncrl-v3"
        assert len(calls["/collective_rpc"]) == 1
        assert [c["lora_name"] for c in calls["/v1/unload_lora_adapter"]] == ["asyncrl-v1"]
        assert await fake.attr("loras") == {"asyncrl-v2": paths[1], "asyncrl-v3": paths[2]}
        with pytest.raises(WeightSyncError, match="base of version 7"):
            await eng.update_weights(WeightUpdate(version=4, adapter_path=paths[0],
                                                  base_version=7))


@pytest.mark.parametrize(("case", "words"), [("rank", "HTTP 400: LoRA rank 16 is greater"),
                                             ("not_adapter", "HTTP 404: .*No adapter found")])
async def test_a_refused_adapter_is_a_weight_sync_error_with_the_servers_words(
        lora_fake, session, tmp_path, case, words):
    path = _adapter(tmp_path / "a", rank=16) if case == "rank" else str(tmp_path)
    async with engine(lora_fake, session) as eng:
        with pytest.raises(WeightSyncError, match=words):
            await eng.update_weights(WeightUpdate(version=1, adapter_path=path))
        assert eng.policy_version == 0 and await lora_fake.attr("loras") == {}
        await collect(eng, make_request(max_new=2))
        assert (await lora_fake.calls("/v1/completions"))[-1]["model"] == "asyncrl"


async def test_a_server_without_runtime_lora_refuses_the_adapter(fake, session, tmp_path):
    # the module's server runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no LoRA routes
    async with engine(fake, session) as eng:
        with pytest.raises(WeightSyncError, match="load_lora_adapter -> HTTP 404"):
            await eng.update_weights(WeightUpdate(version=1, adapter_path=_adapter(tmp_path / "a")))
        assert eng.policy_version == 0
        await collect(eng, make_request(max_new=2))
        assert (await fake.calls("/v1/completions"))[-1]["model"] == "asyncrl"


def test_launched_servers_run_by_the_configured_interpreter_with_its_environment(tmp_path):
    from asyncrl.engine.remote.engine import RemoteOptions
    from asyncrl.engine.vllm.engine import build_vllm_engines

    cfg = VLLMEngineConfig(python="/venv/bin/python", base_port=31234,
                           env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
    (eng,) = build_vllm_engines(cfg, model_path="/m", run_dir=tmp_path)
    assert eng._argv("/m")[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert eng.options.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    assert eng.options.log_dir == str(tmp_path / "engines")
    # The caller's options win over the config's.
    (eng,) = build_vllm_engines(cfg, model_path="/m", remote_options=RemoteOptions(
        python="/other/python", env={"OMP_NUM_THREADS": "2"}))
    assert eng._argv("/m")[0] == "/other/python"
    assert eng.options.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}


async def test_a_stream_sent_on_a_connection_the_server_closed_is_sent_again(fake, session,
                                                                             monkeypatch):
    """uvicorn closes keep-alive connections idle for 5 s; the first send after a longer
    weight update meets one ("Can not write request body") and goes again on a new one."""
    import aiohttp

    post, failures = aiohttp.ClientSession.post, []

    def stale_once(self, url, **kw):
        if url.endswith("/v1/completions") and not failures:
            failures.append(url)
            raise aiohttp.ClientOSError(None, f"Can not write request body for {url}")
        return post(self, url, **kw)

    async with engine(fake, session) as eng:
        monkeypatch.setattr(aiohttp.ClientSession, "post", stale_once)
        g = await collect(eng, make_request(max_new=4))
        assert len(g.token_ids) == 4 and failures and eng.healthy
        assert len(await fake.calls("/v1/completions")) == 1
