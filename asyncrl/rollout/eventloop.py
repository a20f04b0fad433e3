"""The one event loop: uvloop when installed, asyncio's otherwise.

Owns: how a top-level coroutine is run (`run`) and which loop implementation that is
(`loop_kind`). Everything async in asyncrl runs on the loop this starts; nothing hosts a loop
in a thread.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:  # optional: the stock loop is correct, only slower
        return None
    return uvloop


def loop_kind() -> str:
    """"uvloop" when `run` will use it, else "asyncio"."""
    return "uvloop" if _uvloop() is not None else "asyncio"


def freeze_gc() -> int:
    """Collect, then move every object alive now to the garbage collector's permanent
    generation; returns how many were frozen.

    In a process that has loaded torch and transformers, a full (gen-2) collection scans
    millions of objects and stalls the event loop for tens of milliseconds. Frozen objects are
    never scanned again (they are still freed by reference counting; only cycles among them
    would be kept). Call it once setup is done (models, tokenizers, engines loaded); `run`
    calls it before starting the loop.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None, freeze: bool = True) -> T:
    """Run `main` to completion on a fresh event loop (uvloop when installed).

    `freeze`: `freeze_gc()` first, so full collections during the run scan only what the run
    allocates (objects created later, e.g. a model loaded inside `main`, can be frozen by
    calling `freeze_gc()` again once they are loaded).
    """
    if freeze:
        freeze_gc()
    uv = _uvloop()
    if uv is not None:
        return uv.run(main, debug=debug)
    return asyncio.run(main, debug=debug)
