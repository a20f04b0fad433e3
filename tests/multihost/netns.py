"""Hosts on one machine for tests: network namespaces on a private switch, each with its own
198.18.0.x address (RFC 2544's benchmarking range), commands run inside them, and a cleanup
that always runs.

    with Hosts(2) as net:                       # host 0 = 198.18.0.1, host 1 = 198.18.0.2
        p = net.spawn(1, [sys.executable, "-m", "http.server", "--bind", net.addr(1)])
        net.run(0, ["curl", f"http://{net.addr(1)}:8000"])
        net.link(1, up=False)                   # cut host 1 off the switch

Layout: one namespace per host (`<prefix>h<i>`) and one for the switch (`<prefix>sw`, a
bridge). Each host's `eth0` is one end of a veth pair whose other end is a bridge port in the
switch namespace. Both ends are created directly inside their namespaces, so no interface,
address or route is ever added to the machine's own network namespace, and deleting the
namespaces removes everything.

Cleanup (`close`, also on an exception or a test timeout unwinding the `with`): every process
started here is killed with its process group, then every process still inside one of the
namespaces (children that left the group), then the namespaces are deleted. The prefix holds
this process's pid, so concurrent test runs never share names.

`unavailable()` says why the harness cannot run here (not root, no `ip`, network namespaces
not permitted), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

NETWORK = "198.18.0"
_counter = 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces and veth pairs)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    probe = f"arlprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces are not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def our_namespaces(prefix: str) -> list[str]:
    """Names from `ip netns list` that start with `prefix`."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


class Hosts:
    """`n` hosts on one switch; see the module docstring. Use as a context manager."""

    def __init__(self, n: int = 2) -> None:
        global _counter
        if not 1 <= n <= 250:
            raise ValueError("1..250 hosts")
        _counter += 1
        self.n = n
        self.prefix = f"arl{os.getpid()}n{_counter}"
        self.switch = f"{self.prefix}sw"
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    # ------------------------------------------------------------------------------ naming
    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def addr(self, i: int) -> str:
        """Host i's address (host 0 is .1)."""
        return f"{NETWORK}.{i + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.ns(i) for i in range(self.n)] + [self.switch]

    # ----------------------------------------------------------------------------- set up
    def __enter__(self) -> Hosts:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns, port = self.ns(i), f"p{i}"
            self._add_ns(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # -------------------------------------------------------------------------- commands
    def argv(self, i: int, argv: Sequence[str], *, keep_sys: bool = False) -> list[str]:
        """`argv` wrapped to run inside host i. `keep_sys`: join only its network namespace
        (`nsenter`), keeping the machine's /sys and its cgroup mounts, which `ip netns exec`
        hides behind a fresh sysfs (slurmd needs them)."""
        if keep_sys:
            return ["nsenter", f"--net=/run/netns/{self.ns(i)}", *argv]
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def spawn(self, i: int, argv: Sequence[str], *, keep_sys: bool = False,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside host i in its own process group; killed at `close`."""
        proc = subprocess.Popen(self.argv(i, argv, keep_sys=keep_sys), start_new_session=True,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside host i to completion (text output captured)."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.argv(i, argv), text=True, timeout=timeout, **kwargs)

    def link(self, i: int, *, up: bool) -> None:
        """Connect (up) or cut (down) host i's link to the switch."""
        _ip("-n", self.ns(i), "link", "set", "eth0", "up" if up else "down")

    # ---------------------------------------------------------------------------- clean up
    def close(self) -> None:
        """Kill what was started, then anything left inside the namespaces, then delete them."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for name in self._made:
            for _ in range(3):
                pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
