"""LoRA weight sync with the `sglang` engine against the out-of-process SGLang fake: the base
once by `/update_weights_from_disk`, then each version's PEFT adapter by `/load_lora_adapter`,
every request naming the newest adapter in `lora_path`, tokens tagged with the version of the
adapter that produced them, old adapters unloaded; refusals are `WeightSyncError`s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from fakes.control import FakeProcess
from fakes.sglang_server import ScriptedModel

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.remote.engine import RemoteOptions
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.errors import WeightSyncError

FAST = RemoteOptions(health_interval_s=0.1, health_timeout_s=1.0, health_failures=2,
                     control_timeout_s=3.0, weight_timeout_s=10.0, load_ttl_s=0.0,
                     startup_timeout_s=10.0, stop_grace_s=2.0)


def req(n: int = 5) -> GenerateRequest:
    return GenerateRequest(request_id=f"l{id(object())}", input_ids=[11, 12, 13],
                           sampling=SamplingParams(max_new_tokens=n))


def expected(weights: str, n: int = 5) -> list[int]:
    m, ids = ScriptedModel(), []
    for i in range(n):
        ids.append(m.step(weights, [11, 12, 13, *ids], i)[0])
    return ids


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[FakeProcess, FakeProcess]]:
    """One server launched with LoRA enabled (rank up to 8), one without."""
    base = ("--model-path", "/fake/model", "--incremental-streaming-output")
    with FakeProcess("sglang_server.py", *base, "--enable-lora", "--max-lora-rank", "8",
                     "--lora-target-modules", "all") as lora, \
            FakeProcess("sglang_server.py", *base) as plain:
        yield lora, plain


@pytest.fixture
async def fake(servers) -> FakeProcess:
    await servers[0].reset()
    return servers[0]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def make(fake: FakeProcess, http: aiohttp.ClientSession) -> SGLangEngine:
    return SGLangEngine(SGLangEngineConfig(), index=0, session=http, url=fake.url,
                        model_path="/fake/model", options=msgspec.structs.replace(FAST))


def adapter_dir(path: Path, rank: int = 4) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(path)


async def test_a_lora_trainer_syncs_base_once_then_only_adapters(fake, http, tmp_path) -> None:
    """A real LoRA trainer through the train loop's push: the fake reads the PEFT directory
    the trainer wrote, and serves each request with the adapter of the newest version."""
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config import AlgorithmSection, LoraSection, TorchTrainerConfig
    from asyncrl.trainer.torch_trainer import TorchTrainer
    from asyncrl.weightsync.push import push_weights

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64))
    tr = TorchTrainer(model, TorchTrainerConfig(lora=LoraSection(rank=4, alpha=8)),
                      AlgorithmSection(lr=1e-2), pad_token_id=0)
    async with make(fake, http) as eng:
        for version in (1, 2, 3):
            tr.sft_step([([3, 4, 5, 6, 7 + version], [0, 0, 1, 1, 1])])
            await push_weights([eng], tr, version, "disk", tmp_path)
            adapter = str(tmp_path / "weights" / f"v{version}" / "adapter")
            g = await collect(eng, req())
            base = str(tmp_path / "weights" / "v1")
            assert g.token_ids == expected(f"{base}+lora:{adapter}")
        sent = (await fake.calls("/generate"))[-1]
        assert sent["lora_path"] == "asyncrl-v3"
        async for d in eng.stream(req(2)):
            assert d.policy_version == 3  # the adapter's version, not the server's tag (1)
    assert [c["model_path"] for c in await fake.calls("/update_weights_from_disk")] == [base]
    loads = await fake.calls("/load_lora_adapter")
    assert [c["lora_name"] for c in loads] == ["asyncrl-v1", "asyncrl-v2", "asyncrl-v3"]
    assert [c["lora_name"] for c in await fake.calls("/unload_lora_adapter")] == ["asyncrl-v1"]
    assert set(await fake.attr("loras")) == {"asyncrl-v2", "asyncrl-v3"}
    assert not (tmp_path / "weights" / "v2").exists() and (tmp_path / "weights" / "v1").exists()


async def test_an_adapter_over_another_base_is_refused_before_any_call(fake, http,
                                                                        tmp_path) -> None:
    async with make(fake, http) as eng:
        up = WeightUpdate(version=2, adapter_path=adapter_dir(tmp_path / "a"), base_version=1)
        with pytest.raises(WeightSyncError, match="base of version 1"):
            await eng.update_weights(up)
        await eng.update_weights(WeightUpdate(version=1, path="/fake/base1",
                                              adapter_path=adapter_dir(tmp_path / "b")))
        await eng.update_weights(up)
        assert eng.policy_version == 2
    assert [c["lora_name"] for c in await fake.calls("/load_lora_adapter")] == \
        ["asyncrl-v1", "asyncrl-v2"]


async def test_in_memory_adapters_are_refused_with_the_fix(fake, http) -> None:
    async with make(fake, http) as eng:
        with pytest.raises(WeightSyncError, match='weight_sync = "disk"'):
            await eng.update_weights(WeightUpdate(version=1, adapter={}, base_version=0))


@pytest.mark.parametrize("case", ["no_lora", "rank", "not_adapter"])
async def test_a_refused_adapter_is_a_weight_sync_error_with_the_servers_words(
        servers, http, tmp_path, case: str) -> None:
    lora, plain = servers
    await lora.reset()
    await plain.reset()
    fake: Any = plain if case == "no_lora" else lora
    path = adapter_dir(tmp_path / "a", rank=16 if case == "rank" else 4)
    if case == "not_adapter":
        path = str(tmp_path)
    words = {"no_lora": "--enable-lora", "rank": "max-lora-rank",
             "not_adapter": "adapter_config.json"}[case]
    async with make(fake, http) as eng:
        with pytest.raises(WeightSyncError, match=words):
            await eng.update_weights(WeightUpdate(version=1, adapter_path=path))
        assert eng.policy_version == 0
        g = await collect(eng, req())  # resumed, serving the base
        assert g.token_ids == expected("/fake/model")
        assert "lora_path" not in (await fake.calls("/generate"))[-1]
