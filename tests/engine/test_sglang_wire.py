"""The `sglang` engine's wire details as pure functions, and the router's worker API.

Pure: rids no abort can over-match, stream events (null logprobs, malformed entries, weight
version tags), `/v1/loads` summed over DP ranks with its age, dtype names, error messages.
Against fakes (each its own process, one per module, reset before each test): capacity with
attention-DP ranks, `sampling_seed` only where the server uses it, an abort that arrives
before its request, router registration through `POST /workers`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from fakes.control import FakeProcess
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, collect
from asyncrl.engine.remote.engine import RemoteOptions
from asyncrl.engine.sglang.engine import SGLangEngine, decode_event, parse_loads, wire_rid
from asyncrl.engine.sglang.router import register_worker
from asyncrl.engine.sglang.weights import server_message, torch_dtype_names
from asyncrl.errors import EngineError, EngineUnavailable, WeightSyncError

FAST = RemoteOptions(health_interval_s=0.2, health_timeout_s=1.0, health_failures=2,
                     control_timeout_s=3.0, weight_timeout_s=5.0, load_ttl_s=0.0,
                     startup_timeout_s=5.0, stop_grace_s=2.0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture(scope="module")
def processes() -> Iterator[tuple[FakeProcess, FakeProcess]]:
    """A fake SGLang server and a fake sglang-router, each a process of its own."""
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                     "--incremental-streaming-output") as server, \
            FakeProcess("sglang_router.py") as router:
        yield server, router


@pytest.fixture
async def fake(processes) -> FakeProcess:
    await processes[0].reset()
    return processes[0]


@pytest.fixture
async def router(processes) -> FakeProcess:
    await processes[1].reset()
    return processes[1]


# ---------------------------------------------------------------------------- pure
@given(st.text(max_size=12), st.text(max_size=12))
def test_no_wire_rid_is_a_prefix_of_another(a: str, b: str) -> None:
    if a != b:
        assert not wire_rid(b).startswith(wire_rid(a))
    assert wire_rid(a).endswith("#") and wire_rid(a).count("#") == 1


def _event(entries, total=None, finish=None, version="default"):
    return {"output_ids": [e[1] for e in entries if len(e) > 1],
            "meta_info": {"output_token_logprobs": entries, "finish_reason": finish,
                          "completion_tokens": total if total is not None else len(entries),
                          "weight_version": version}}


def test_a_null_logprob_is_an_error_not_probability_one() -> None:
    state = {"n": 0, "incr": True}
    with pytest.raises(EngineError, match=r"null \(non-finite\) logprob for token 21 at output "
                                          r"position 1"):
        decode_event(_event([[-0.5, 20, None], [None, 21, None]]), state, "s")


def test_stream_events_of_the_wrong_shape_are_errors() -> None:
    for bad in ([1, 2], {"meta_info": {}}, {"meta_info": {"output_token_logprobs": "x"}},
                _event([["a"]])):
        with pytest.raises(EngineError):
            decode_event(bad, {"n": 0, "incr": True}, "s")  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="context length"):
        decode_event({"error": {"message": "longer than the context length"}}, {"n": 0}, "s")


def test_stream_events_carry_the_servers_weight_version() -> None:
    state = {"n": 0, "incr": True}
    d = decode_event(_event([[-0.1, 20, None]], version="7"), state, "s")
    assert d is not None and state["version"] == 7
    decode_event(_event([[-0.1, 21, None]], total=2, version="default"), state, "s")
    assert state["version"] is None  # an untagged server: the engine's own version is used


def test_loads_are_summed_over_dp_ranks_and_aged_by_the_oldest_snapshot() -> None:
    data = {"loads": [
        {"dp_rank": 0, "timestamp": 100.0, "num_used_tokens": 10, "num_total_tokens": 30,
         "max_total_num_tokens": 500, "num_running_reqs": 2, "num_waiting_reqs": 1},
        {"dp_rank": 1, "timestamp": 99.0, "num_used_tokens": 5, "num_total_tokens": 5,
         "max_total_num_tokens": 500, "num_running_reqs": 1, "num_waiting_reqs": 0}]}
    load = parse_loads(data, "s", 0, now=100.5)
    assert (load.kv_tokens_used, load.kv_tokens_capacity) == (35, 1000)
    assert (load.running, load.waiting, load.age_s) == (3, 1, 1.5)
    for bad in ({}, {"loads": []}, {"loads": [{"num_running_reqs": 1}]}, [1]):
        with pytest.raises(EngineError, match="unrecognised /v1/loads"):
            parse_loads(bad, "s", 0, now=0.0)


def test_dtype_names_are_torch_attribute_names() -> None:
    assert torch_dtype_names(["torch.bfloat16", "float32"]) == ["bfloat16", "float32"]
    with pytest.raises(WeightSyncError, match="not a torch dtype"):
        torch_dtype_names(["Size"])


def test_server_messages_are_read_from_every_error_shape() -> None:
    assert server_message(b'{"success": false, "message": "no session"}') == "no session"
    assert server_message(b'{"error": {"message": "bad rid"}}') == "bad rid"
    assert server_message(b'{"detail": "Not Found"}') == "Not Found"
    assert server_message(b"Internal Server Error") == "Internal Server Error"


# ---------------------------------------------------------------------- with fakes
async def test_capacity_counts_every_attention_dp_rank(fake, http) -> None:
    await fake.set(core__capacity=4000, dp_size=1, attn_dp_size=4)
    async with SGLangEngine(SGLangEngineConfig(), index=0, session=http, url=fake.url,
                            options=FAST) as eng:
        assert eng.capacity == 4000  # 1000 per rank x 4 ranks
        assert (await eng.load()).kv_tokens_capacity == 4000


async def test_sampling_seed_is_sent_only_to_a_deterministic_server(fake, http) -> None:
    r = GenerateRequest(request_id="s", input_ids=[11],
                        sampling=SamplingParams(max_new_tokens=2, seed=5))
    async with SGLangEngine(SGLangEngineConfig(), index=0, session=http, url=fake.url,
                            options=FAST) as eng:
        await collect(eng, r)
        assert "sampling_seed" not in (await fake.calls("/generate"))[0]["sampling_params"]
        eng._deterministic = True  # what /server_info says under deterministic inference
        await collect(eng, r)
        assert (await fake.calls("/generate"))[1]["sampling_params"]["sampling_seed"] == 5


async def test_an_abort_that_arrives_before_its_request_ends_it_at_once(fake, http) -> None:
    async with SGLangEngine(SGLangEngineConfig(), index=0, session=http, url=fake.url,
                            options=FAST) as eng:
        await eng.abort("early")
        g = await collect(eng, GenerateRequest(
            request_id="early", input_ids=[11],
            sampling=SamplingParams(max_new_tokens=500)))
        assert g.finish_reason == "abort" and g.token_ids == []
        assert "/generate" not in await fake.calls()


async def test_launched_servers_never_return_untempered_logprobs(http, tmp_path,
                                                                 monkeypatch) -> None:
    import msgspec

    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    probe = ("import os, sys; print('ENV', os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB'));"
             " sys.exit(3)")
    opts = msgspec.structs.replace(FAST, launcher=(sys.executable, "-c", probe),
                                   log_dir=str(tmp_path))
    eng = SGLangEngine(SGLangEngineConfig(), index=0, session=http, port=29999,
                       model_path="/fake/m", options=opts)
    with pytest.raises(EngineUnavailable, match="ENV None"):
        await eng.start()
    await eng.close()


async def test_router_registration_waits_until_the_worker_is_healthy(fake, router, http) -> None:
    await router.set(add_delay_s=0.3)
    async with http.post(router.url + "/add_worker", params={"url": fake.url}) as r:
        assert r.status == 404  # sglang-router 0.3.2 has no /add_worker
    await register_worker(http, router.url, fake.url, timeout_s=5, poll_s=0.05)
    assert (await router.attr("workers"))[fake.url]["is_healthy"]


async def test_router_registration_of_a_worker_that_never_turns_healthy_times_out(fake, router,
                                                                                  http):
    await fake.set(starting=True)  # /health answers 503
    async with asyncio.timeout(5):
        with pytest.raises(EngineUnavailable, match="did not report"):
            await register_worker(http, router.url, fake.url, timeout_s=1.0, poll_s=0.05)
    with pytest.raises(EngineError, match="HTTP 400"):
        await register_worker(http, router.url, "not-a-url", timeout_s=1.0)
