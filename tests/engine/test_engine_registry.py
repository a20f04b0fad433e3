"""Engine registry: config section -> engines, by kind."""

from __future__ import annotations

import pytest

from asyncrl.config import LocalEngineConfig, SGLangEngineConfig
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.engine.registry import ENGINE_KINDS, build_engines, register_engine_kind
from asyncrl.errors import ConfigError


def test_local_kind_builds_a_local_engine(tiny_model_factory, tiny_tokenizer) -> None:
    cfg = LocalEngineConfig(kv_token_budget=1000, max_running=3)
    engines = build_engines(cfg, tiny_model_factory(0), tiny_tokenizer, run_dir="ignored")
    assert len(engines) == 1 and isinstance(engines[0], LocalEngine)
    assert engines[0].kv_token_budget == 1000 and engines[0].max_running == 3


def test_local_kind_needs_a_model() -> None:
    with pytest.raises(ConfigError, match=r"engine\.kind"):
        build_engines(LocalEngineConfig())


def test_unregistered_kind_is_a_config_error(monkeypatch) -> None:
    monkeypatch.delitem(ENGINE_KINDS, "sglang", raising=False)
    with pytest.raises(ConfigError, match="sglang"):
        build_engines(SGLangEngineConfig(urls=["http://x"]))


def test_register_a_kind(monkeypatch) -> None:
    monkeypatch.setitem(ENGINE_KINDS, "sglang", ENGINE_KINDS.get("sglang"))
    made = []
    register_engine_kind("sglang", lambda cfg, **kw: made.append(cfg) or ["engine"])
    assert build_engines(SGLangEngineConfig(urls=["http://x"])) == ["engine"]
    assert made and made[0].urls == ["http://x"]
