"""The vLLM family: one vLLM server (`engine.VLLMEngine`) and its fleet builder."""

from __future__ import annotations

from asyncrl.engine.lazy import lazy_exports

_EXPORTS = {
    "VLLMEngine": "engine",
    "build_vllm_engines": "engine",
    "open_vllm_engines": "engine",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
