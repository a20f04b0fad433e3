"""The remote-server engine family: what every HTTP inference server shares.

`RemoteEngine` (supervision, relaunch, the update sequence, streaming through `stream`), the
server process (`process`), HTTP helpers (`http`, `wire`), the load cache (`load`), launch
options (`options`), the LoRA adapter slots both server kinds keep (`lora_slots`) and the one
fleet builder (`fleet`). The SGLang and vLLM families subclass it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RemoteEngine": "engine",
    "open_all": "engine",
    "RemoteOptions": "options",
    "with_log_dir": "options",
    "ServerProcess": "process",
    "pick_ports": "process",
}
"""Name -> the submodule that defines it; loaded on first use, so importing one
submodule (a light one, say) never loads the others."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
