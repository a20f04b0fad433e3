"""The remote-server engine family: what every HTTP inference server shares.

`RemoteEngine` (supervision, relaunch, the update sequence, streaming through `stream`), the
server process (`process`), HTTP helpers (`http`, `wire`), the load cache (`load`), launch
options (`options`), the LoRA adapter slots both server kinds keep (`lora_slots`) and the one
fleet builder (`fleet`). The SGLang and vLLM families subclass it."""

from __future__ import annotations

from asyncrl.engine.lazy import lazy_exports

_EXPORTS = {
    "RemoteEngine": "engine",
    "open_all": "engine",
    "RemoteOptions": "options",
    "with_log_dir": "options",
    "ServerProcess": "process",
    "pick_ports": "process",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
