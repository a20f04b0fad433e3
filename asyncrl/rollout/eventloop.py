"""The one event loop: uvloop when installed, asyncio's otherwise.

Owns: how a top-level coroutine is run (`run`) and which loop implementation that is
(`loop_kind`). Everything async in asyncrl runs on the loop this starts; nothing hosts a loop
in a thread.
"""

from __future__ import annotations

import asyncio
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


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run `main` to completion on a fresh event loop (uvloop when installed)."""
    uv = _uvloop()
    if uv is not None:
        return uv.run(main, debug=debug)
    return asyncio.run(main, debug=debug)
