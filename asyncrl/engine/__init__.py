"""Inference engines behind one protocol (`base.Engine`)."""

from asyncrl.engine.base import (
    Engine,
    EngineLoad,
    GenerateRequest,
    Generation,
    SamplingParams,
    TokenDelta,
    WeightUpdate,
    collect,
)
from asyncrl.engine.local import LocalEngine
from asyncrl.engine.registry import ENGINE_KINDS, build_engines, register_engine_kind

__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "EngineLoad",
    "GenerateRequest",
    "Generation",
    "LocalEngine",
    "SamplingParams",
    "TokenDelta",
    "WeightUpdate",
    "build_engines",
    "collect",
    "register_engine_kind",
]
