"""Engine kinds: the registry that turns an `[engine]` config section into engines.

Owns: `ENGINE_KINDS` (kind name -> builder) and `build_engines`. Does not own: any engine, or
starting them (engines are opened by the caller with `async with`).

A builder is `builder(cfg, *, model=None, tokenizer=None, **options) -> list[Engine]`; it gets
only its own config section. Other engine modules register themselves with
`register_engine_kind("sglang", build_sglang)` (or by adding to `ENGINE_KINDS`) when imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.engine.base import Engine
from asyncrl.errors import ConfigError

EngineBuilder = Callable[..., list[Engine]]


def _build_local(cfg: Any, *, model: Any = None, tokenizer: Any = None,
                 **options: Any) -> list[Engine]:
    """One in-process `LocalEngine` over `model` (moved to `cfg.device`; pass a copy if a
    trainer keeps training the original). Uses the options `name`, `seed`, `admit_reserve` and
    `record_routing` (routing replay) when given; ignores the others (`run_dir`, `model_path`, ... are for other kinds)."""
    from asyncrl.engine.local.engine import LocalEngine

    if model is None or tokenizer is None:
        raise ConfigError("engine.kind", "the local engine needs a model and a tokenizer")
    if cfg.prefix_cache_tokens and options.get("record_routing"):
        raise ConfigError("engine.prefix_cache_tokens", "the continuation cache does not "
                          "record MoE routing, which routing replay needs: set it to 0, or "
                          "turn routing replay off (`algorithm.routing_replay`)")
    if cfg.decode == "static" and options.get("record_routing"):
        raise ConfigError("engine.decode", "\"static\" does not record MoE routing, which "
                          "routing replay needs (`algorithm.routing_replay`, on by default for "
                          "an MoE model): use decode = \"eager\", or turn routing replay off")
    opts: dict[str, Any] = {"name": "local-0"}
    opts.update({k: v for k, v in options.items() if k in ("name", "seed", "admit_reserve",
                                                                "record_routing")})
    return [LocalEngine(model, tokenizer, kv_token_budget=cfg.kv_token_budget,
                        max_running=cfg.max_running, device=cfg.device, threads=cfg.threads,
                        packed=cfg.packed_linears, decode=cfg.decode,
                        cuda_graphs=cfg.cuda_graphs,
                        prefix_cache_tokens=cfg.prefix_cache_tokens, **opts)]


def _build_sglang(cfg: Any, **options: Any) -> list[Engine]:
    """SGLang servers (launched or attached); see
    `asyncrl.engine.sglang.fleet.build_sglang_engines` for the options it uses (`model_path`,
    `run_dir`, `session`, `remote_options`)."""
    from asyncrl.engine.sglang.fleet import build_sglang_engines

    return build_sglang_engines(cfg, **options)


def _build_vllm(cfg: Any, **options: Any) -> list[Engine]:
    """vLLM servers (launched or attached); see `asyncrl.engine.vllm.engine.build_vllm_engines`."""
    from asyncrl.engine.vllm.engine import build_vllm_engines

    return list(build_vllm_engines(cfg, **options))


ENGINE_KINDS: dict[str, EngineBuilder] = {"local": _build_local, "sglang": _build_sglang,
                                          "vllm": _build_vllm}
"""Kind name (the `engine.kind` config key) -> builder."""


def register_engine_kind(kind: str, builder: EngineBuilder) -> None:
    """Add (or replace) the builder for `kind`."""
    ENGINE_KINDS[kind] = builder


def build_engines(cfg: Any, model: Any = None, tokenizer: Any = None,
                  **options: Any) -> list[Engine]:
    """Engines for an engine config section (`LocalEngineConfig`, ...), not yet started.

    `cfg.kind` picks the builder from `ENGINE_KINDS`; `model`/`tokenizer` are for in-process
    kinds; `options` are passed to the builder, which ignores those it does not use (so one call
    site serves every kind: `run_dir=`, `model_path=`, ...). Raises `ConfigError("engine.kind")` for a kind
    with no registered builder (e.g. "sglang" when its module was not imported).
    """
    kind = cfg.kind
    try:
        builder = ENGINE_KINDS[kind]
    except KeyError:
        raise ConfigError("engine.kind", f"no engine builder registered for kind {kind!r}; "
                          f"registered: {sorted(ENGINE_KINDS)}") from None
    return builder(cfg, model=model, tokenizer=tokenizer, **options)
