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

__all__ = [
    "Engine",
    "EngineLoad",
    "GenerateRequest",
    "Generation",
    "SamplingParams",
    "TokenDelta",
    "WeightUpdate",
    "collect",
]
