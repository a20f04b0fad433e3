"""Inference engines behind one protocol (`base.Engine`).

The protocol and the registry load with the package; `LocalEngine` (torch) loads on first use,
so code that only types against `Engine` never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from asyncrl.engine.local.engine import LocalEngine


def __getattr__(name: str) -> Any:
    if name == "LocalEngine":
        from asyncrl.engine.local.engine import LocalEngine

        return LocalEngine
    raise AttributeError(f"module 'asyncrl.engine' has no attribute {name!r}")
