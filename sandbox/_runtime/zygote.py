"""The zygote: one worker of the pool, which forks one contained child per call.

This module is the worker's entry point (``main``: its lifecycle) and the map of the rest.

Two shapes, one protocol towards the pool (``protocol``):

- **Templates** (``spawner = template``, the default when the C module ``_forkserver`` is
  built). This process is the *controller*: it reads the config, forks a *main template*
  (every preload) and a *light template* (``light_preload``: the standard library's common
  pure-Python modules), and only then imports what serving needs (msgspec, epoll, sockets), so
  the templates do not map them. A template imports its preloads, warms them up, freezes its
  heap, prepares the Landlock ruleset and the seccomp program, self-tests them, and enters
  ``_forkserver.serve``: a loop in C that forks on request, applies the containment in C and
  returns into Python only in the child, with the call. The controller does all per-call
  bookkeeping (working directories, pipes, deadlines, output capture, answers); the templates
  write nothing between forks. Why: on this machine (nested virtualisation) a page fault costs
  ~4 us, and a zygote that forks from its own Python loop re-faults ~190 pages per call, its
  children ~200 more while containing themselves in Python; every memory region of the forked
  process also costs ~1.8 us per fork and exit (the light template maps ~100, the main one
  ~330). A program goes to the light template when the imports its text shows are all loaded
  there (``light_enough``); anything else, and every hosted function, to the main one.
- **Python** (``spawner = python``, or no C module): this process imports the preloads and
  forks each child itself (glibc ``fork`` through ctypes); the child contains itself
  (``child.setup``). Same containment, same answers, about half the throughput.

Lifecycle: read the config frame (marshal) on stdin, prepare (above), report ready, serve. The
loop is a single-threaded epoll loop: requests from the pool on fd 0, answers on fd 1, per
child its stdout/stderr/status pipes, and per template its socket (or, in the Python shape,
per child a pidfd). Every child has a wall-clock deadline; past it the child is SIGKILLed
(with its process group; by its template, which alone reaps it, so a pid is never reused
under a kill). Neither the controller nor a template runs model code.

Where each part lives: the event loop, start-up order, routing, deadlines and shutdown in
``controller``; what the process children fork from does (a template, or this process in the
Python shape) in ``template``; a call's record, pipes, working directory and answer in
``children``; how a finished child becomes an answer in ``outcome``; the warm-up and
huge-page work in ``warm``; the child's own steps in ``child``.

Exit: EOF on stdin (the pool went away or closed us) -> kill every child and exit. A template
that dies takes its worker down (the pool fails that worker's calls in flight and starts a new
one).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import signal

from . import child as childmod
from . import protocol
from .controller import Controller

_libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _libc.prctl(childmod._PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with our starter
    inbuf = bytearray()
    frames: list[bytes] = []
    while not frames:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        inbuf += chunk
        frames = protocol.split_frames(inbuf)
    cfg = marshal.loads(frames[0])
    if not cfg.get("jailed"):
        # On the host, the pool dying (even SIGKILLed) should not leave working directories
        # behind: ask for SIGTERM instead, and clean up on it. (In a jail, SIGKILL: the jail's
        # tmpfs disappears with it, and SIGKILL also ends a zygote that is stopped or stuck.)
        _libc.prctl(childmod._PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        signal.signal(signal.SIGTERM, _exit_on_signal)
    z = Controller(cfg)
    # requests sent before we were ready are served after start-up, in order
    z.inbuf = bytearray(b"".join(protocol.HEADER.pack(len(f)) + f for f in frames[1:])) + inbuf
    try:
        z.prepare()
        z.send([0, "ready", z.info])
        z.flush()
        z.serve()
    except SystemExit:
        z.shutdown()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
