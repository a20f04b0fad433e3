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


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None,
        freeze_gc: bool = True) -> T:
    """Run `main` to completion on a fresh event loop (uvloop when installed).

    `freeze_gc`: move every object alive now (imported modules: torch, transformers, ...) to
    the garbage collector's permanent generation first, so a full collection during the run
    scans only what the run allocated (in a process with torch loaded, an unfrozen gen-2
    collection stalls the loop for tens of milliseconds).
    """
    if freeze_gc:
        gc.collect()
        gc.freeze()
    uv = _uvloop()
    if uv is not None:
        return uv.run(main, debug=debug)
    return asyncio.run(main, debug=debug)
