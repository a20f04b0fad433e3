"""The vLLM family: one vLLM server (`engine.VLLMEngine`) and its fleet builder."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VLLMEngine": "engine",
    "build_vllm_engines": "engine",
    "open_vllm_engines": "engine",
}
"""Name -> the submodule that defines it; loaded on first use, so importing one
submodule (a light one, say) never loads the others."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
