"""The one event loop: uvloop when installed, asyncio's otherwise, and what keeps it responsive.

Owns: how a top-level coroutine is run (`run`), which loop implementation that is
(`loop_kind`), and the garbage-collector settings that keep the loop from stalling
(`freeze_gc`, `quiet_gc`). Everything async in asyncrl runs on the loop this starts;
nothing hosts a loop in a thread.

Why the collector matters: a rollout holds its tokens, mask and logprobs as Python lists, and a
full (gen-2) collection visits every element of every live list. With 10,000 rollouts in flight
that is ~10^8 visits: a full collection stalls the loop for a second. Young collections are
not cheap either at that scale (see `quiet_gc`): while a run is in flight, `quiet_gc` leaves
only a memory backstop of automatic collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from asyncrl.log import get_logger
from asyncrl.rollout import blocking

log = get_logger(__name__)

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


RUN_GC_BACKSTOP = 50_000
"""Default `quiet_gc` backstop: container objects (net) allocated since the last collection."""


@contextlib.contextmanager
def quiet_gc(backstop: int = RUN_GC_BACKSTOP) -> Iterator[None]:
    """No routine automatic collections inside; on the way out the thresholds are restored
    and one full collection runs (cycles made meanwhile are freed then, not lost).

    Why not only the full ones: with thousands of rollouts streaming, young collections are
    not cheap either. The young generation's trigger counts allocations *net of
    deallocations*; every stream wait leaves a few objects (a future, an awaitable, a
    callback, the engine's read handle) that live a second or so, and while older ones die
    at the rate new ones are made the count stays under its threshold (700) as the young
    list grows to hold the whole in-flight set: at 10,000 rollouts, young collections of
    50-90k objects took 40-75 ms, middle ones up to 100 ms, and almost nothing they visit is
    garbage (reference counting frees it; cyclic garbage measured ~100 objects/s: exception
    tracebacks, cancelled tasks).

    Inside, a young collection runs only once `backstop` container objects (net) were
    allocated since the last one: a memory bound on short-lived cyclic garbage, at about a
    microsecond per live young object each time it fires (tens of ms at the default; a few
    times while 10,000 rollouts start, every several seconds after). What survives it is the
    run's live state (rollouts, records, waits in flight) and is not traced again until the
    run ends: no middle or full collections inside. The collector is process-wide, so uses
    are counted: the first to enter sets the quiet thresholds, the last to leave (in any
    order: a training run's prefetched rollouts and an evaluation overlap) restores what the
    first found and collects.
    """
    if backstop < 1:
        raise ValueError("backstop must be >= 1")
    global _quiet_depth, _quiet_saved
    if _quiet_depth == 0:
        _quiet_saved = gc.get_threshold()
        if _quiet_saved[0] != 0:  # automatic collection off already: leave it so
            gc.set_threshold(max(_quiet_saved[0], backstop), 1 << 30, 1 << 30)
    _quiet_depth += 1
    try:
        yield
    finally:
        _quiet_depth -= 1
        if _quiet_depth == 0:
            gc.set_threshold(*_quiet_saved)
            if _quiet_saved[0] != 0:
                gc.collect()


_quiet_depth = 0
_quiet_saved: tuple[int, ...] = (700, 10, 10)


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None, freeze: bool = True) -> T:
    """Run `main` to completion on a fresh event loop (uvloop when installed).

    `freeze`: `freeze_gc()` first, so full collections during the run scan only what the run
    allocates (objects created later, e.g. a model loaded inside `main`, can be frozen by
    calling `freeze_gc()` again once they are loaded).

    User code that never returned after its deadline (`asyncrl.rollout.blocking`) does not
    delay the return; it is named in a `sync_calls_stuck` warning.
    """
    if freeze:
        freeze_gc()
    uv = _uvloop()
    try:
        if uv is not None:
            return uv.run(main, debug=debug)
        return asyncio.run(main, debug=debug)
    finally:
        if blocking.stuck():
            log.warning("sync_calls_stuck", detail=blocking.describe_stuck())
