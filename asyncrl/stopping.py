"""Stopping a run on request: SIGINT / SIGTERM become a stop request, with a deadline.

Owns: `StopRequest` (the state a signal sets: which signal, when, how many), `race` (await
something unless a stop comes first), `signal_handlers` (the process's SIGINT and SIGTERM
handlers while a run is live) and the hard exit taken when the grace period runs out or on a
second Ctrl-C. Does not own: what a stop saves or prints (the train loop and `asyncrl train`).

The contract with the loop. The first signal sets the request; the loop notices it at its next
boundary (before a step, or while waiting for rollouts, an eval or the hard filter: `race`
raises `RunStopped` there), writes a checkpoint of the last completed step and returns through
its normal cleanup (the progress display is restored, engines and sandbox closed). A trainer
step already running (`trainer_step`) is given up between two micro-batches, its weights
untouched (`StepAbandoned`): an SFT step at once, an RL update once half the grace is gone
(it finishes if it can: its rollouts are lost with it), and only before its first optimizer
step (with `algorithm.optimizer_steps_per_rl_step` > 1, one that has taken it finishes).
Trainers that cannot give a step up (multi-rank ones) finish it, and it is saved. If all that takes
longer than `grace_s`, or a second SIGINT arrives, the process leaves at once with
`os._exit(128 + signum)`: a checkpoint being written then stays an invisible `.tmp-*`
directory (`asyncrl.checkpoint`'s atomic rename), never a half-written `step_*`.

Handlers are Python-level (`signal.signal`): they run on the main thread between bytecodes,
so a stop is seen even while the loop's thread is busy; they only set state, wake the loop
with `call_soon_threadsafe`, and start the deadline's timer thread (a daemon), which fires even
when the loop is stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from asyncrl.errors import RunStopped, StepAbandoned
from asyncrl.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SHOW_CURSOR = "\x1b[?25h"
"""Written to a terminal on a hard exit: the live display hides the cursor while it is up."""


class StopRequest:
    """Set once by the first stop signal (or by `request` from an embedding program)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None
        """`time.monotonic()` of the first request."""
        self.count = 0
        self.grace_s: float | None = None
        """The grace period the signal handlers enforce (None: no deadline, e.g. a stop an
        embedding program requests without them)."""
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the loop the run is on (the event `race` waits for lives there)."""
        self._loop = loop
        self._event = asyncio.Event()
        if self.requested:
            self._event.set()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the run to stop (idempotent; thread- and signal-handler-safe)."""
        self.count += 1
        if self.signum is not None:
            return
        self.signum, self.at = signum, time.monotonic()
        if self._loop is not None and self._event is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nothing waits
                self._loop.call_soon_threadsafe(self._event.set)

    def check(self) -> None:
        """Raise `RunStopped` if a stop was requested (call at a step boundary)."""
        if self.requested:
            raise RunStopped(self.name)

    def overdue(self, share: float) -> bool:
        """Whether a step still running should be given up (`StepAbandoned`, at its next
        micro-batch, its weights untouched): a stop was requested and `share` of the grace
        period is gone. `share` 0 gives up at once; without a grace period only `share` 0
        does. What it is for: a step longer than the grace (a real model's SFT step on a CPU,
        an RL update of many rollouts) would otherwise be cut by the hard exit, and with it
        every step since the last checkpoint."""
        if not self.requested:
            return False
        if share <= 0:
            return True
        if self.grace_s is None or self.at is None:
            return False
        return time.monotonic() - self.at >= share * self.grace_s

    async def race(self, aw: Awaitable[T]) -> T:
        """`await aw`, unless a stop comes first: then `aw` is cancelled (and awaited) and
        `RunStopped` is raised. A stop requested before the call raises at once."""
        if self.requested:
            if asyncio.iscoroutine(aw):
                aw.close()  # never started: nothing to clean up
            elif isinstance(aw, asyncio.Future):
                aw.cancel()
            raise RunStopped(self.name)
        task = asyncio.ensure_future(aw)
        if self._event is None:
            return await task
        waiter = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not task.done():  # stopped, or this coroutine itself was cancelled
                task.cancel()
                # shielded: the aborted work's own cleanup runs to its end even if we are
                # cancelled meanwhile
                await asyncio.shield(asyncio.gather(task, return_exceptions=True))
        if task.cancelled():
            raise RunStopped(self.name)
        return task.result()


SFT_GIVE_UP = 0.0
"""An SFT step is given up as soon as a stop comes: it is one batch, redone on resume."""
RL_GIVE_UP = 0.5
"""An RL update runs on while half the grace remains: giving it up loses its rollouts (a
resumed run samples them again), so it finishes if it can, and else leaves the other half for
the checkpoint."""


async def trainer_step(stop: StopRequest | None, share: float, call: Callable[..., T],
                       *args: Any) -> T:
    """`call(*args, give_up=...)` (a trainer's `sft_step` or `train_step`) in a worker thread,
    asked to give the step up once `stop.overdue(share)` (a `call` without that parameter, a
    trainer of the embedding program's own, runs as before). Its `StepAbandoned` (a `RunStopped`)
    leaves with the stop's signal named; the weights are the last completed step's."""
    if stop is None or not _takes_give_up(call):  # a trainer written before `give_up`: the
        return await asyncio.to_thread(call, *args)  # step finishes, as it always did
    try:
        return await asyncio.to_thread(call, *args, give_up=lambda: stop.overdue(share))
    except StepAbandoned as e:
        e.signal_name = stop.name
        log.warning("step_abandoned", signal=stop.name,
                    after_s=round(time.monotonic() - (stop.at or time.monotonic()), 2))
        raise


def _takes_give_up(call: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "give_up" or p.kind is p.VAR_KEYWORD for p in params)


def _hard_exit(stop: StopRequest, why: str, describe: Callable[[], str]) -> None:
    """Leave now: restore the terminal, say what is on disk, `os._exit(128 + signum)`."""
    try:
        if sys.stderr.isatty():
            sys.stderr.write(SHOW_CURSOR)
        sys.stderr.write(f"\nasyncrl: {why}; exiting without a new checkpoint. {describe()}\n")
        sys.stderr.flush()
        log.warning("stop_hard_exit", why=why, signal=stop.name)
    except Exception:  # nothing may keep this process from exiting now
        pass
    os._exit(128 + (stop.signum or signal.SIGTERM))


@contextlib.contextmanager
def signal_handlers(stop: StopRequest, grace_s: float, *, describe: Callable[[], str] = str,
                    enabled: bool = True) -> Iterator[StopRequest]:
    """While inside: SIGINT / SIGTERM request a stop (see the module doc); `describe()` says
    what is on disk (the newest checkpoint and the resume command) on a hard exit. Must be
    entered on the main thread with the run's loop running. Previous handlers come back on exit.
    `enabled=False` (`checkpoint.on_signal = false`) leaves the handlers as they are."""
    stop.bind(asyncio.get_running_loop())
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    grace_before, stop.grace_s = stop.grace_s, grace_s
    timers: list[threading.Timer] = []

    def on_signal(signum: int, _frame: Any) -> None:
        first = not stop.requested
        stop.request(signum)
        name = signal.Signals(signum).name
        if not first:
            if signum == signal.SIGINT:  # a second Ctrl-C: the user wants out now
                _hard_exit(stop, f"second {name}", describe)
            return  # a repeated SIGTERM (a scheduler's reminder) changes nothing
        log.warning("stop_requested", signal=name, grace_s=grace_s)
        with contextlib.suppress(Exception):  # the console may be gone (a closed pipe)
            sys.stderr.write(f"\nasyncrl: {name}: stopping after the current step and saving "
                             f"a checkpoint (within {grace_s:g}s"
                             + ("; Ctrl-C again to stop at once)\n" if signum == signal.SIGINT
                                else ")\n"))
            sys.stderr.flush()
        timer = threading.Timer(grace_s, _hard_exit,
                                (stop, f"the stop did not finish within {grace_s:g}s", describe))
        timer.daemon = True
        timer.start()
        timers.append(timer)

    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        yield stop
    finally:
        stop.grace_s = grace_before
        for s, h in previous.items():
            signal.signal(s, h)
        for t in timers:
            t.cancel()
