"""Routing replay through the `sglang` engine, against the fake SGLang server (a process of its
own): the request asks for `return_routed_experts`, the last delta carries the experts decoded
from `meta_info.routed_experts` (base64 int32 `[prompt + completion - 1, layers, top_k]`), a
launched server gets `--enable-return-routed-experts`, and a server without it is an error
that says so. vLLM refuses routing replay at construction."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from fakes.control import FakeProcess
from fakes.sglang_server import routed_expert
from remote_helpers import FAST, make_request

from asyncrl.config import SGLangEngineConfig, VLLMEngineConfig
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.vllm.engine import build_vllm_engines
from asyncrl.errors import ConfigError, EngineError

CFG = SGLangEngineConfig(request_timeout_s=30.0)
ROUTED = msgspec.structs.replace(FAST, routed_experts=(2, 2))


@pytest.fixture(scope="module")
def server() -> Iterator[FakeProcess]:
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                     "--incremental-streaming-output", "--enable-return-routed-experts") as f:
        yield f


@pytest.fixture
async def fake(server) -> FakeProcess:
    await server.reset()
    return server


async def _run(fake, session, options, prompt, n):
    async with SGLangEngine(CFG, index=0, session=session, url=fake.url, options=options) as e:
        return [d async for d in e.stream(make_request(prompt, max_new=n))]


async def test_asks_for_and_decodes_the_routed_experts(fake, session):
    prompt, n = [11, 12, 13, 14], 6
    deltas = await _run(fake, session, ROUTED, prompt, n)
    body = (await fake.calls("/generate"))[0]
    assert body["return_routed_experts"] is True
    assert all(d.routed_experts is None for d in deltas[:-1])
    rec = deltas[-1].routed_experts
    assert (rec.layers, rec.top_k, rec.itemsize) == (2, 2, 1)
    assert rec.tokens == len(prompt) + n - 1  # the last token is never fed back
    got = np.frombuffer(rec.data, dtype=np.uint8).reshape(rec.tokens, 2, 2)
    want = [[[routed_expert(p, layer, j, 8) for j in range(2)] for layer in range(2)]
            for p in range(rec.tokens)]
    assert got.tolist() == want


async def test_many_experts_travel_as_uint16(fake, session):
    await fake.set(routing_shape=[2, 2, 300])
    rec = (await _run(fake, session, ROUTED, list(range(1, 41)), 5))[-1].routed_experts
    assert rec.itemsize == 2
    got = np.frombuffer(rec.data, dtype="<u2").reshape(rec.tokens, 2, 2)
    assert int(got.max()) >= 255 and got[1, 1, 1] == routed_expert(1, 1, 1, 300)


async def test_off_asks_for_nothing(fake, session):
    deltas = await _run(fake, session, FAST, [1, 2, 3], 3)
    assert "return_routed_experts" not in (await fake.calls("/generate"))[0]
    assert deltas[-1].routed_experts is None


async def test_server_without_the_flag_is_an_error_that_says_so(session):
    with FakeProcess("sglang_server.py", "--model-path", "/fake/model",
                     "--incremental-streaming-output") as plain:
        with pytest.raises(EngineError, match="--enable-return-routed-experts"):
            await _run(plain, session, ROUTED, [1, 2, 3], 3)


def test_launch_command_enables_it():
    eng = SGLangEngine(CFG, index=0, model_path="/m", port=30000, options=ROUTED)
    assert "--enable-return-routed-experts" in eng._argv("/m")
    assert "--enable-return-routed-experts" not in SGLangEngine(
        CFG, index=0, model_path="/m", port=30000, options=FAST)._argv("/m")


def test_vllm_refuses_routing_replay():
    with pytest.raises(ConfigError, match="routing_replay"):
        build_vllm_engines(VLLMEngineConfig(urls=["http://127.0.0.1:1"]), record_routing=True)


def _meta(arr: np.ndarray, prompt: int, completion: int) -> dict:
    import base64

    return {"routed_experts": base64.b64encode(arr.astype("<i4").tobytes()).decode(),
            "prompt_tokens": prompt, "completion_tokens": completion}


def test_rows_must_be_prompt_plus_completion_minus_one():
    from asyncrl.engine.sglang.engine import routed_experts

    arr = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 8  # 5 rows of 2 layers x top-2
    rec = routed_experts(_meta(arr, 4, 2), 2, 2, "e")
    assert np.frombuffer(rec.data, dtype="<u1").reshape(5, 2, 2).tolist() == arr.tolist()
    # Read as one layer's top-2 (10 rows), or against a token too many, the bytes do not line up.
    with pytest.raises(EngineError, match="not prompt_tokens"):
        routed_experts(_meta(arr, 4, 2), 1, 2, "e")
    with pytest.raises(EngineError, match="not prompt_tokens"):
        routed_experts(_meta(arr, 4, 3), 2, 2, "e")


def test_fused_shared_expert_columns_are_refused():
    from asyncrl.engine.sglang.engine import routed_experts

    # One layer, top-2 plus a fused shared expert's column of -1: 3 rows' worth of top-2 values.
    arr = np.array([[[3, 5, -1]], [[1, 2, -1]]])
    with pytest.raises(EngineError, match="negative expert ids"):
        routed_experts(_meta(arr, 2, 2), 1, 2, "e")
