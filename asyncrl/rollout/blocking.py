"""Synchronous user code off the event loop, on threads that cannot keep the process alive.

Owns `call_sync(fn, *args, what=...)`: await a plain (blocking) function written by a user (a
sync tool, a text environment's `make_env` / `init` / `step` / `close`, a sync reward) without
stalling the loop, and `stuck()`: the calls abandoned by their caller (a deadline, a stop)
that have not returned yet. Does not own the deadlines themselves (each caller's
`asyncio.timeout`) or asyncrl's own blocking work (trainer steps, file writes), which stays on
the loop's default executor: that code returns.

Why not `asyncio.to_thread`: its threads belong to the loop's default executor, and both
`asyncio.run` (`shutdown_default_executor`) and the interpreter's exit (`threading._shutdown`
joins every `ThreadPoolExecutor` worker) wait for them. A user's `step` that never returns
(`time.sleep(3600)`, a socket read with no timeout) was correctly cut by its deadline, yet
kept `asyncrl train` alive after `run_done` and an embedding program's `run_loop` from ever
returning; a Ctrl-C landed in `threading._shutdown`. Here each call runs on a daemon thread of
its own (a thread cannot be killed in Python; a daemon one is simply not waited for at exit),
and a call its caller stopped waiting for is remembered by name so the end of the run can say
what hung (`asyncrl.rollout.eventloop.run` logs `sync_calls_stuck`).

Cost: one thread start per call (tens of microseconds), small next to a tool or an
environment step; concurrency is bounded by the callers (rollouts in flight), as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from asyncrl.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_abandoned: dict[int, tuple[str, float]] = {}
"""Call id -> (what, monotonic start) for calls whose caller gave up and that still run.
Process-wide on purpose: threads are, and the exit that must not wait for them is."""
_next_id = 0


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the caller gave up (cancelled): nobody reads it
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


async def call_sync(fn: Callable[..., T], /, *args: Any, what: str, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a daemon thread; its result or exception. `what` names the
    call for a person (`"tool 'count_letter'"`, `"environment step"`). Cancelling the await
    (a deadline, a stop) abandons the call: its thread runs on until `fn` returns, is named by
    `stuck()` meanwhile, and never delays the process's exit."""
    global _next_id
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    ctx = contextvars.copy_context()  # log bindings (rollout id, step) follow the call
    finished = [False]
    with _lock:
        _next_id += 1
        call_id = _next_id

    def work() -> None:
        ok: bool = True
        value: Any = None
        try:
            value = ctx.run(fn, *args, **kwargs)
        except BaseException as e:  # handed to the awaiting coroutine, which re-raises it
            ok, value = False, e
        with _lock:
            finished[0] = True
            late = _abandoned.pop(call_id, None)
        if late is not None:
            log.info("sync_call_returned_late", what=what,
                     after_s=round(time.monotonic() - late[1], 1))
            return
        try:
            loop.call_soon_threadsafe(_settle, fut, ok, value)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    t0 = time.monotonic()
    threading.Thread(target=work, name=f"asyncrl-sync:{what}"[:60], daemon=True).start()
    try:
        return await fut
    except asyncio.CancelledError:
        with _lock:
            running = not finished[0]
            if running:
                _abandoned[call_id] = (what, t0)
        if running:  # the line that says what hung, when it is cut
            log.warning("sync_call_abandoned", what=what,
                        after_s=round(time.monotonic() - t0, 1))
        raise


def stuck() -> list[tuple[str, float]]:
    """(what, seconds running) of each abandoned call still running, longest first."""
    now = time.monotonic()
    with _lock:
        items = list(_abandoned.values())
    return sorted(((w, round(now - t, 1)) for w, t in items), key=lambda x: -x[1])


def describe_stuck() -> str:
    """One line naming the abandoned calls still running (empty when none)."""
    calls = stuck()
    if not calls:
        return ""
    counts: dict[str, int] = {}
    for w, _ in calls:
        counts[w] = counts.get(w, 0) + 1
    names = ", ".join(f"{w}" + (f" x{n}" if n > 1 else "") for w, n in counts.items())
    return (f"{len(calls)} call(s) of user code never returned after their deadline "
            f"({names}; the longest for {calls[0][1]:g}s); left on daemon threads, "
            "not waited for")
