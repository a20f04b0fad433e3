"""The in-process engine family: `LocalEngine` (torch, continuous batching over a KV cache,
LoRA by merging) and its parts: the batched cache (`batch`, `kvcache`), sampling (`sampling`)
and the adapter merge (`lora_merge`)."""

from __future__ import annotations

from asyncrl.engine.lazy import lazy_exports

_EXPORTS = {
    "LocalEngine": "engine",
    "AdapterMerger": "lora_merge",
    "read_adapter_dir": "lora_merge",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
