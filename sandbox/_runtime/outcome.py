"""How a finished child becomes an answer: bounded output capture and the status rules.

Pure functions and a small buffer class, no I/O: the zygote feeds them what it observed.
"""

from __future__ import annotations

import signal

from .child import EXIT_MEMORY


class Stream:
    """Capture of one child pipe: keep the head and a bounded tail, count what is dropped."""

    __slots__ = ("fd", "head", "head_cap", "open", "tail", "tail_cap", "total")

    def __init__(self, fd: int, cap: int) -> None:
        self.fd = fd
        self.open = True
        self.head = bytearray()
        self.tail = bytearray()
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            extra = len(self.tail) - self.tail_cap
            if extra > 0:
                del self.tail[:extra]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def data(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        dropped = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... sandbox: {dropped} bytes of output omitted ...]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)



def exec_outcome(code: int, *, setup_ok: bool, timed_out: bool, cancelled: bool, limit_s: float,
                 note: str, stderr: str) -> tuple[str, int, str]:
    """(status, exit_code, detail) of a program run from its wait status ``code``
    (``os.waitstatus_to_exitcode``: negative = killed by that signal)."""
    detail = note
    if cancelled:
        return "sandbox_failure", code, "cancelled by the caller"
    if timed_out:
        return "timeout", code, _join(detail, f"wall-clock limit of {limit_s:g}s exceeded")
    if not setup_ok:
        how = f"signal {signame(-code)}" if code < 0 else f"status {code}"
        return "sandbox_failure", code, _join(
            detail, f"sandbox setup failed in the child ({how}): " + stderr.strip()[-500:])
    if code == 0:
        return "ok", 0, detail
    if code == EXIT_MEMORY:
        return "killed", 1, _join(detail, "memory limit exceeded (MemoryError)")
    if code == -signal.SIGXCPU:
        return "timeout", code, _join(detail, "CPU-time limit exceeded")
    if code == -signal.SIGXFSZ:
        return "killed", code, _join(detail, "file size limit exceeded")
    if code == -signal.SIGKILL:
        return "killed", code, _join(detail, "killed by SIGKILL (out of memory?)")
    if code < 0:
        return "error", code, _join(detail, f"terminated by signal {signame(-code)}")
    return "error", code, detail


def call_outcome(code: int, status_data: bytes, *, timed_out: bool, cancelled: bool,
                 limit_s: float, log: str) -> tuple[str, bytes | None, str]:
    """(status, pickled payload or None, detail) of a hosted function call."""
    if cancelled:
        return "sandbox_failure", None, "cancelled by the caller"
    if timed_out:
        return "timeout", None, f"function exceeded its {limit_s:g}s deadline"
    if not status_data.startswith(b"R"):
        return "sandbox_failure", None, "sandbox setup failed: " + log[-500:]
    if code != 0 or len(status_data) < 2:
        return "error", None, f"function process ended with status {code}: " + log[-1000:]
    return "ok", status_data[1:], ""


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
