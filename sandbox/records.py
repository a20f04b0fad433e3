"""Request and result records of the sandbox: what a caller sends and what it gets back.

These are plain msgspec Structs so they cross the HTTP boundary unchanged (JSON or msgpack).
They import nothing from the rest of the package.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from .errors import FunctionCallError, FunctionError, FunctionTimeout


class ExecStatus(enum.StrEnum):
    """Outcome of one execution. Compares equal to its string value (``r.status == "ok"``).

    - ``ok``: the program ran to the end and exited 0.
    - ``error``: the program failed: an uncaught exception, a non-zero exit, a syntax error,
      or a crash by a signal it caused itself (SIGSEGV...). ``detail`` says which.
    - ``timeout``: the wall-clock limit (or the CPU-time limit) was reached; the process group
      was killed.
    - ``killed``: another limit was hit: memory (MemoryError / OOM kill), file size.
    - ``sandbox_failure``: the sandbox could not run or answer the call (worker died or wedged,
      setup failed, node unreachable after retries, overload seen by a client). Not the
      program's fault; callers should not penalise the model for it.
    """

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"
    SANDBOX_FAILURE = "sandbox_failure"


class ExecRequest(msgspec.Struct, frozen=True):
    """One tool call: run ``code`` as a fresh ``__main__`` program with ``stdin`` as input.

    ``time_limit_s`` is the wall-clock limit in seconds; ``None`` takes the pool default.
    Values above the pool's ``max_time_limit_s`` are capped (and the cap is noted in
    ``ExecResult.detail``).
    """

    code: str
    stdin: str = ""
    time_limit_s: float | None = None


class ExecResult(msgspec.Struct, frozen=True):
    """The answer to one ``ExecRequest``; every call gets exactly one.

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced) and capped at the pool's
    ``max_output_bytes`` each: the head and the tail are kept and the middle is replaced by a
    marker line, with ``truncated`` set. ``exit_code`` is the process exit status, ``-signum``
    when it ended by a signal, ``None`` when the program never ran to an exit the sandbox could
    observe (``sandbox_failure``). ``duration_s`` is wall-clock seconds from fork to exit.
    """

    status: ExecStatus
    stdout: str
    stderr: str
    exit_code: int | None
    duration_s: float
    truncated: bool
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ExecStatus.OK

    @classmethod
    def failure(cls, detail: str, duration_s: float = 0.0) -> ExecResult:
        """A ``sandbox_failure`` result carrying ``detail``."""
        return cls(ExecStatus.SANDBOX_FAILURE, "", "", None, duration_s, False, detail)


class FunctionStatus(enum.StrEnum):
    """Outcome of a hosted function call (``SandboxPool.call_function``)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    SANDBOX_FAILURE = "sandbox_failure"


class FunctionResult(msgspec.Struct, frozen=True):
    """The answer to ``call_function``: ``value`` is the unpickled return value when ok."""

    status: FunctionStatus
    value: Any = None
    detail: str = ""
    duration_s: float = 0.0

    def unwrap(self) -> Any:
        """Return ``value`` if ok, else raise FunctionTimeout / FunctionError / FunctionCallError."""
        if self.status is FunctionStatus.OK:
            return self.value
        if self.status is FunctionStatus.TIMEOUT:
            raise FunctionTimeout(self.detail)
        if self.status is FunctionStatus.ERROR:
            raise FunctionError(self.detail)
        raise FunctionCallError(self.detail)
