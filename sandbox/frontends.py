"""Several HTTP front ends on one port: ``sandbox serve --front-ends N``.

Owns the supervisor: it binds the node's listening socket once, plus one private socket per
front end on a free port, then forks N front-end processes that each run ``server.serve`` on
the shared socket and on its own private one, with its own ``SandboxPool`` (the node's
``--workers`` split between them); it prints one ready line when all are serving, forwards
SIGTERM/SIGINT to them and waits. Does not own HTTP handling or the pool.

Why: one server process does every request's HTTP parsing, msgpack and pool bookkeeping on
one event loop, one core. On a node with many cores that loop, not the zygotes, caps the calls
per second (16 cores: HTTP 81% of the in-process pool). N processes sharing one listening
socket scale that part with the cores, with no new IPC: each front end is a whole node in
miniature.

Balance: on the shared port the kernel gives each new connection to whichever front end
accepts first, and a keep-alive connection then stays with it, so a client with few
connections can pile its calls on one front end while another idles (measured: 64 W7 calls,
each holding a slot for 4 s, took four 4 s waves instead of two). Hence the private ports: the
full ``/health`` body lists them (``front_end_ports``, by index), and ``HttpSandboxClient``
treats each front end as a node of its own, sending each batch to the one with the fewest
calls outstanding. The shared port stays for probes, load balancers and simple clients.

Contract and limits:
- Every front end enforces the same token and reports the same isolation level (each pool
  resolves it on the same host; a front end that cannot start makes the node fail to start).
- ``/health`` and ``/metrics`` describe the front end that answered (``front_end`` index in
  the health body, ``sandbox_front_end_index`` gauge): scrape each front end on its private
  port and sum per node.
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
from dataclasses import dataclass

from .config import PoolConfig
from .errors import SandboxConfigError

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class FrontEnd:
    """This process's place among its node's front ends."""

    index: int = 0
    ports: tuple[int, ...] = ()
    """Every front end's private port, by index; empty when the node has one process."""

    @property
    def count(self) -> int:
        return max(1, len(self.ports))


SINGLE = FrontEnd()


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
              run_front_end: Callable[[PoolConfig, list[socket.socket], FrontEnd, int], int]
              ) -> int:
    """Bind ``host:port`` and a private port per front end, fork ``front_ends`` processes
    running ``run_front_end(cfg_i, [shared, private], front_end, ready_fd)`` and supervise
    them; returns the exit code. ``run_front_end`` writes its ready line to ``ready_fd`` and
    closes it once it serves."""
    shares = split_workers(cfg.workers, front_ends)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    private = [socket.create_server((host, 0), family=family, backlog=2048)
               for _ in range(front_ends)]
    ports = tuple(s.getsockname()[1] for s in private)
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
                for j, other in enumerate(private):
                    if j != index:
                        other.close()
                code = run_front_end(msgspec.structs.replace(cfg, workers=workers),
                                     [sock, private[index]], FrontEnd(index, ports), write_fd)
            except BaseException as exc:  # broad: report, then leave without unwinding
                print(f"sandbox front end {index}: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                code = 2
            finally:
                os._exit(code)
        children[pid] = index
    os.close(write_fd)
    for s in (sock, *private):  # the front ends hold them
        s.close()

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
              f"front_ends={front_ends} front_end_ports={','.join(map(str, ports))}",
              flush=True)
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
