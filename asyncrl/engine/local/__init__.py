"""The in-process engine family: `LocalEngine` (torch, continuous batching over a KV cache,
LoRA by merging) and its parts: the batched cache (`batch`, `kvcache`), sampling (`sampling`)
and the adapter merge (`lora_merge`)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LocalEngine": "engine",
    "AdapterMerger": "lora_merge",
    "read_adapter_dir": "lora_merge",
}
"""Name -> the submodule that defines it; loaded on first use, so importing one
submodule (a light one, say) never loads the others."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
