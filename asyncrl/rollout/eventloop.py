"""The one event loop: uvloop when installed, asyncio's otherwise, and what keeps it responsive.

Owns: how a top-level coroutine is run (`run`), which loop implementation that is
(`loop_kind`), and the garbage-collector settings that keep the loop from stalling
(`freeze_gc`, `deferred_full_gc`). Everything async in asyncrl runs on the loop this starts;
nothing hosts a loop in a thread.

Why the collector matters: a rollout holds its tokens, mask and logprobs as Python lists, and a
full (gen-2) collection visits every element of every live list. With 10,000 rollouts in flight
that is ~10^8 visits: a full collection stalls the loop for a second. Young collections stay
cheap (recent objects only).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Coroutine, Iterator
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


@contextlib.contextmanager
def deferred_full_gc() -> Iterator[None]:
    """No automatic full collections inside; on the way out the thresholds are restored and
    one full collection runs (cycles made meanwhile are freed then, not lost).

    Young-generation collections still run; the middle generation is collected every 2 young
    collections instead of 10 (the same work in pauses a fifth as long: each stream wait leaves
    a future, a timer and a delta that live seconds and pass through it). The collector is process-wide: nested uses are
    fine (each restores what it found); overlapping non-nested uses may end the deferral early
    (slower, never incorrect).
    """
    before = gc.get_threshold()
    gc.set_threshold(before[0], 2, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if before[2] < (1 << 30):
            gc.collect()


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
