"""The SGLang 0.5.23 contract the `sglang` engine relies on, one set of assertions for two
servers: the fake (`tests/fakes/sglang_server.py`, default suite) and a real SGLang server
(`gpu` marker; launched from a tiny model when `sglang` and a CUDA GPU are present).

Each test states a property of the real server the engine depends on (the audit row it comes
from is in `docs/research/sglang-contract-audit.md`), so a fake that drifts from the real
server, or an engine that drifts from both, fails here. Properties that need the fake's
failure knobs are in `test_sglang_weights.py`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from fakes.control import FakeProcess

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions
from asyncrl.engine.sglang.engine import SGLangEngine

OPTIONS = RemoteOptions(health_interval_s=0.5, health_timeout_s=30.0, health_failures=3,
                        control_timeout_s=30.0, weight_timeout_s=300.0, load_ttl_s=0.0,
                        startup_timeout_s=30.0)
CFG = SGLangEngineConfig(request_timeout_s=120.0)


@dataclass
class Server:
    kind: str
    url: str
    alt_weights: str
    """A second weights directory: loading it changes greedy outputs."""
    health_timeout_s: float
    """How long the server's /health waits for a token before its 503."""


def _req(rid: str, n: int, ids: list[int] | None = None, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=ids or [11, 12, 13, 14],
                           sampling=SamplingParams(max_new_tokens=n, temperature=0.0, **kw))


# ---------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, tiny_tokenizer) -> Iterator[Server]:
    """A real SGLang server on a tiny random Qwen3 (fp32, torch-native attention), launched
    once per module; skipped where SGLang or a GPU is missing."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (pip install -e '.[gpu]')")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from asyncrl.modeling import build_model, save

    tiny = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    base = save(build_model(tiny, tiny_tokenizer, seed=0), tiny_tokenizer,
                tmp_path_factory.mktemp("sglang_base"))
    alt = save(build_model(tiny, tiny_tokenizer, seed=1), tiny_tokenizer,
               tmp_path_factory.mktemp("sglang_alt"))
    port = _free_port()
    log = open(tmp_path_factory.mktemp("sglang_log") / "server.log", "wb")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(base), "--host",
         "127.0.0.1", "--port", str(port), "--mem-fraction-static", "0.3",
         "--enable-metrics", "--incremental-streaming-output", "--dtype", "float32",
         "--attention-backend", "torch_native", "--context-length", "4096",
         "--random-seed", "0"], stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=30) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang did not start (rc={proc.poll()}), see {log.name}")
            time.sleep(2)
        yield Server("real", url, str(alt), health_timeout_s=20.0)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeProcess]:
    """The fake as its own process, like the real server: one per module, reset per test."""
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                     "--incremental-streaming-output", "--fake-token-delay", "0.005",
                     "--fake-health-check-timeout", "0.5") as fake:
        yield fake


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.gpu)])
async def server(request, tmp_path) -> AsyncIterator[Server]:
    if request.param == "real":
        yield request.getfixturevalue("real_server")
        return
    fake = request.getfixturevalue("fake_server")
    await fake.reset()
    yield Server("fake", fake.url, str(tmp_path), health_timeout_s=0.5)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def engine(server: Server, http) -> AsyncIterator[SGLangEngine]:
    async with SGLangEngine(CFG, index=0, session=http, url=server.url,
                            options=OPTIONS) as eng:
        yield eng


# ------------------------------------------------------------------------------ tests
async def test_server_info_gives_per_rank_kv_capacity(server, http, engine):
    # row 14: /server_info is flat; max_total_num_tokens is one DP rank's pool
    async with http.get(server.url + "/server_info") as r:
        assert r.status == 200
        info = await r.json()
    per_rank = info["max_total_num_tokens"]
    assert isinstance(per_rank, int) and per_rank > 0
    ranks = (info.get("dp_size") or 1) * (info.get("attn_dp_size") or 1)
    assert engine.capacity == per_rank * ranks
    assert info["incremental_streaming_output"] is True  # both are launched with the flag


async def test_stream_gives_logprobs_and_keeps_the_stop_token(engine):
    # rows 3-5, 7-10: input ids in, output ids with finite logprobs out, stop id kept
    g = await collect(engine, _req("c-len", 8))
    assert len(g.token_ids) == 8 and g.finish_reason == "length"
    assert all(lp <= 0.0 for lp in g.logprobs) and len(g.logprobs) == 8
    stop = g.token_ids[3]
    s = await collect(engine, _req("c-stop", 8, stop_token_ids=(stop,)))
    assert s.finish_reason == "stop" and s.token_ids[-1] == stop
    assert s.token_ids == g.token_ids[:g.token_ids.index(stop) + 1]


async def test_unknown_sampling_keys_are_a_400_with_the_reason(server, http):
    # row 4: SamplingParams rejects unknown keys before anything is generated
    body = {"input_ids": [11, 12], "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}}
    async with http.post(server.url + "/generate", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert "unknown field `bogus_key`" in err


async def test_endpoints_the_engine_must_not_use_do_not_exist(server, http):
    # rows 16 and 27: /get_load is gone; /add_worker is a router route of the past
    async with http.get(server.url + "/get_load") as r:
        assert r.status == 404
    async with http.post(server.url + "/add_worker", params={"url": "x"}) as r:
        assert r.status == 404


async def test_loads_endpoint_reports_per_rank_numbers_with_a_timestamp(server, http, engine):
    # row 16: /v1/loads?include=core, one entry per DP rank
    async with http.get(server.url + "/v1/loads", params={"include": "core"}) as r:
        assert r.status == 200
        data = await r.json()
    keys = {"timestamp", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
            "num_total_tokens", "max_total_num_tokens"}
    assert data["loads"] and all(keys <= set(x) for x in data["loads"])
    assert sum(x["max_total_num_tokens"] for x in data["loads"]) == engine.capacity
    load = await engine.load()
    assert load.kv_tokens_capacity == engine.capacity and load.age_s >= 0.0


async def test_abort_matches_rid_prefixes_and_engine_rids_are_exact(server, http, engine):
    # row 13: the scheduler aborts every rid starting with the aborted one
    long = 3000 if server.kind == "real" else 400
    got: dict[str, list] = {"r/t2/1": [], "r/t2/10": []}

    async def run(rid: str) -> str | None:
        async for d in engine.stream(_req(rid, long)):
            got[rid].append(d)
        return got[rid][-1].finish_reason if got[rid] else None

    one = asyncio.create_task(run("r/t2/1"))
    ten = asyncio.create_task(run("r/t2/10"))
    async with asyncio.timeout(30):
        while not (got["r/t2/1"] and got["r/t2/10"]):  # noqa: ASYNC110  (both streaming)
            await asyncio.sleep(0.01)
    await engine.abort("r/t2/1")
    assert await asyncio.wait_for(one, 30) == "abort"
    n = len(got["r/t2/10"])
    await asyncio.sleep(0.3)
    # "r/t2/1" is a prefix of "r/t2/10", the rids the engine sends are not: it goes on
    assert len(got["r/t2/10"]) > n or (ten.done() and ten.result() != "abort")
    await engine.abort("r/t2/10")
    await asyncio.wait_for(ten, 30)
    # the hazard itself, on the raw API: aborting "pre" ends "pre-1"
    body = {"rid": "pre-1", "input_ids": [11, 12], "stream": True,
            "sampling_params": {"max_new_tokens": long, "ignore_eos": True}}
    async with http.post(server.url + "/generate", json=body) as r:
        await r.content.readline()
        async with http.post(server.url + "/abort_request", json={"rid": "pre"}) as a:
            assert a.status == 200
        tail = (await asyncio.wait_for(r.read(), 30)).decode()
    assert '"abort"' in tail


async def test_tensor_and_nccl_loads_need_a_weight_update_session(server, http):
    # rows 22 and 24: update_weights_from_{tensor,distributed} refused outside a session
    async def post(path: str, body: dict) -> tuple[int, dict]:
        async with http.post(server.url + path, json=body) as r:
            return r.status, await r.json()

    payload = {"serialized_named_tensors": ["eA=="], "flush_cache": False}
    status, reply = await post("/update_weights_from_tensor", payload)
    assert status == 400 and reply["success"] is False
    assert "begin_weight_update" in reply["message"]
    assert (await post("/begin_weight_update", {"selector": "all"}))[0] == 200
    status, reply = await post("/begin_weight_update", {"selector": "all"})
    assert status == 400 and "already open" in reply["message"]
    assert (await post("/end_weight_update", {}))[0] == 200
    status, reply = await post("/end_weight_update", {})
    assert status == 400 and reply["success"] is False


async def test_disk_update_tags_tokens_with_the_new_version(server, http, engine):
    # rows 21 and 26: weight_version is set by the update and carried by every chunk
    before = await collect(engine, _req("v-before", 12))
    await engine.update_weights(WeightUpdate(version=3, path=server.alt_weights))
    deltas = [d async for d in engine.stream(_req("v-after", 12))]
    assert {d.policy_version for d in deltas} == {3}
    assert [t for d in deltas for t in d.token_ids] != before.token_ids
    async with http.get(server.url + "/model_info") as r:
        assert (await r.json())["weight_version"] == "3"


async def test_health_generates_so_a_paused_server_fails_it(server, http):
    # row 17: /health needs a token; while paused none comes, and it answers 503
    async with http.get(server.url + "/health") as r:
        assert r.status == 200
    async with http.post(server.url + "/pause_generation", json={"mode": "retract"}) as r:
        assert r.status == 200
    try:
        async with asyncio.timeout(server.health_timeout_s + 15):
            async with http.get(server.url + "/health") as r:
                assert r.status == 503
    finally:
        async with http.post(server.url + "/continue_generation", json={}) as r:
            assert r.status == 200
    async with http.get(server.url + "/health") as r:
        assert r.status == 200


async def test_requests_sent_while_paused_wait_for_continue(server, http, engine):
    # row 18: a retract pause holds new requests until /continue_generation
    async with http.post(server.url + "/pause_generation", json={"mode": "retract"}) as r:
        assert r.status == 200
    task = asyncio.create_task(collect(engine, _req("p-wait", 6)))
    try:
        await asyncio.sleep(1.0)
        assert not task.done()
    finally:
        async with http.post(server.url + "/continue_generation", json={}) as r:
            assert r.status == 200
    g = await asyncio.wait_for(task, 30)
    assert len(g.token_ids) == 6 and g.finish_reason == "length"
