"""The SGLang family: one server (`engine.SGLangEngine`), a router over several
(`router.RoutedSGLangEngine`), its weight endpoints (`weights`) and the fleet builder the registry
calls (`fleet`)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SGLangEngine": "engine",
    "RoutedSGLangEngine": "router",
    "build_sglang_engines": "fleet",
    "open_sglang_engines": "fleet",
}
"""Name -> the submodule that defines it; loaded on first use, so importing one
submodule (a light one, say) never loads the others."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
