"""Several HTTP front ends on one port: ``sandbox serve --front-ends N``.

Owns the supervisor: it binds the listening socket once, forks N front-end processes that
each run ``server.serve`` on that same socket with their own ``SandboxPool`` (the node's
``--workers`` split between them), prints one ready line when all are serving, forwards
SIGTERM/SIGINT to them and waits. Does not own HTTP handling or the pool.

Why: one server process does every request's HTTP parsing, msgpack and pool bookkeeping on
one event loop, one core. On a node with many cores that loop, not the zygotes, caps the calls
per second (16 cores: HTTP 81% of the in-process pool). N processes sharing one listening
socket scale that part with the cores, with no new IPC: each front end is a whole node in
miniature, and the kernel hands each new connection to whichever front end accepts first (an
idle one is already waiting in ``accept``). A connection then stays with its front end
(keep-alive), so the client should use at least as many connections as there are front ends
(``HttpSandboxClient`` opens one per batch in flight).

Contract and limits:
- Every front end enforces the same token and reports the same isolation level (each pool
  resolves it on the same host; a front end that cannot start makes the node fail to start).
- ``/health`` and ``/metrics`` describe the front end that answered (``front_end`` index in
  the health body, ``sandbox_front_end_index`` gauge): scrape each process, or sum per node.
- If a front end dies, the supervisor stops the others and exits 1: the node's supervisor
  (systemd, Kubernetes) restarts it whole rather than run with a silently smaller pool.
- Front ends die with the supervisor (PR_SET_PDEATHSIG), so a killed node leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable

from .config import PoolConfig
from .errors import SandboxConfigError

PR_SET_PDEATHSIG = 1


def split_workers(workers: int, front_ends: int) -> list[int]:
    """Zygote workers of each front end: as even as possible, every one at least 1."""
    if front_ends < 1:
        raise SandboxConfigError(f"front_ends must be >= 1, got {front_ends}")
    if workers < front_ends:
        raise SandboxConfigError(f"{workers} workers cannot be split over {front_ends} front "
                                 "ends (each needs at least one)")
    base, extra = divmod(workers, front_ends)
    return [base + (i < extra) for i in range(front_ends)]


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's SIGTERM still reaches us
        pass


def supervise(cfg: PoolConfig, front_ends: int, host: str, port: int,
              run_front_end: Callable[[PoolConfig, socket.socket, int, int], int]) -> int:
    """Bind ``host:port``, fork ``front_ends`` processes running
    ``run_front_end(cfg_i, sock, index, ready_fd)`` and supervise them; returns the exit code.
    ``run_front_end`` must write its ready line to ``ready_fd`` once it serves."""
    shares = split_workers(cfg.workers, front_ends)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    read_fd, write_fd = os.pipe()
    children: dict[int, int] = {}
    for index, workers in enumerate(shares):
        pid = os.fork()
        if pid == 0:  # front end: never returns into the supervisor's code
            code = 1
            try:
                os.close(read_fd)
                _die_with_parent()
                import msgspec
                code = run_front_end(msgspec.structs.replace(cfg, workers=workers), sock,
                                     index, write_fd)
            except BaseException as exc:  # broad: report, then leave without unwinding
                print(f"sandbox front end {index}: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                code = 2
            finally:
                os._exit(code)
        children[pid] = index
    os.close(write_fd)
    sock.close()  # the front ends hold it

    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            _kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)

    lines = _read_ready(read_fd, front_ends)
    if len(lines) < front_ends:
        print(f"sandbox: {front_ends - len(lines)} of {front_ends} front ends failed to start",
              file=sys.stderr, flush=True)
        forward(signal.SIGTERM, None)
    else:
        addr = lines[0].split()[3]
        rest = " ".join(w for w in lines[0].split()[4:] if not w.startswith("workers="))
        print(f"sandbox serving on {addr} {rest} workers={cfg.workers} "
              f"front_ends={front_ends}", flush=True)
    code = 0 if len(lines) == front_ends else 2
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        children.pop(pid, None)
        rc = os.waitstatus_to_exitcode(status)
        if not stopping:
            print(f"sandbox: front end exited with status {rc}; stopping the node",
                  file=sys.stderr, flush=True)
            code = code or 1
            forward(signal.SIGTERM, None)
    return code


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _read_ready(fd: int, n: int) -> list[str]:
    """Up to ``n`` ready lines; fewer if every writer closed the pipe first."""
    buf = b""
    with os.fdopen(fd, "rb") as f:
        while buf.count(b"\n") < n:
            chunk = f.read1(4096)
            if not chunk:
                break
            buf += chunk
    return [ln for ln in buf.decode().splitlines() if ln.startswith("sandbox serving on ")]
