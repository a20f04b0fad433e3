"""Launched inference servers as child processes: start, stop, never orphaned.

Owns: starting a server command in its own session and process group with its output appended
to a log file, asking the kernel to SIGTERM it if the orchestrator dies (PR_SET_PDEATHSIG, set
in the child before exec), stopping the whole group (SIGTERM, then SIGKILL after a grace), and
picking free ports. Does not own: when to start or restart a server, or talking to it
(`remote.RemoteEngine`).

No orphans: `stop` kills the process group, so workers the server forked go too; a
SIGKILLed orchestrator runs no cleanup code, but the kernel then sends SIGTERM to the server,
whose own shutdown stops its workers (SGLang and vLLM both do on SIGTERM). A worker that
escaped into another session is outside this guarantee.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrl.errors import EngineUnavailable
from asyncrl.log import get_logger

log = get_logger(__name__)


def _die_with_parent(parent_pid: int) -> None:  # pragma: no cover - runs in the child
    """preexec_fn: ask the kernel to SIGTERM this child when the orchestrator dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(host: str, base_port: int, n: int, taken: Sequence[int] = ()) -> list[int]:
    """The first `n` free ports from `base_port` up (each server takes one; SGLang and vLLM
    open further internal ports of their own, so launched servers are spaced by 10)."""
    ports: list[int] = []
    port = base_port
    while len(ports) < n:
        if port > 65535:
            raise EngineUnavailable(f"no free port from {base_port} on {host}")
        if port not in taken and port_is_free(host, port):
            ports.append(port)
            port += 10
        else:
            port += 1
    return ports


class ServerProcess:
    """One launched server: its own process group, output appended to `log_path`.

    `stop` terminates the whole group (the server's own workers included). The child also
    gets PR_SET_PDEATHSIG, so a SIGKILLed orchestrator still takes its servers down.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], log_path: Path,
                 name: str) -> None:
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.name = name
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"\n=== asyncrl launch: {' '.join(self.argv)}\n".encode())
            out.flush()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=self.env, start_new_session=True,
                    preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                )
            except OSError as e:
                raise EngineUnavailable(f"{self.name}: cannot launch {self.argv[0]}: {e}") from e
        log.info("engine_server_launched", engine=self.name, pid=self._proc.pid,
                 log=str(self.log_path))

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)  # the group id is the leader's pid (new session)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, SIGKILL it after `grace_s`. Safe to call twice."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await self._proc.wait()
        except TimeoutError:
            log.warning("engine_server_kill", engine=self.name, pid=self._proc.pid)
        # Workers of the server may outlive the leader: the group goes either way.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._proc.wait()

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])
