"""The SGLang family: one server (`engine.SGLangEngine`), a router over several
(`router.RoutedSGLangEngine`), its weight endpoints (`weights`) and the fleet builder the registry
calls (`fleet`)."""

from __future__ import annotations

from asyncrl.engine.lazy import lazy_exports

_EXPORTS = {
    "SGLangEngine": "engine",
    "RoutedSGLangEngine": "router",
    "build_sglang_engines": "fleet",
    "open_sglang_engines": "fleet",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
