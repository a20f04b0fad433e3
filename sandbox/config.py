"""Configuration of the executor pool (``PoolConfig``) and the isolation levels.

Imports nothing from the rest of the package except its errors. Every field is documented
here, once; validation names the field that is wrong.
"""

from __future__ import annotations

import enum
import math

import msgspec

from .errors import SandboxConfigError

DEFAULT_PRELOAD: tuple[str, ...] = (
    # what model-written math code imports most; preloaded so a call pays no import time
    "numpy", "sympy", "math", "cmath", "fractions", "decimal", "itertools", "functools",
    "collections", "re", "statistics", "random", "heapq", "bisect", "string", "operator",
    "datetime", "json", "typing", "dataclasses", "copy", "numbers", "time", "array",
)


LIGHT_PRELOAD: tuple[str, ...] = (
    # the light template's modules: the common pure-Python ones (and math). Every extension
    # module maps ~5 more regions into it, and each costs every fork and exit; a program that
    # imports anything else forks from the main template, which has it all.
    "math", "fractions", "itertools", "functools", "collections", "re", "random", "heapq",
    "bisect", "string", "operator", "copy", "numbers", "time", "typing",
)


class IsolationLevel(enum.StrEnum):
    """How strongly a call is contained; see ``sandbox.isolation`` for the threat model.

    - ``jail+seccomp``: the workers run in an nsjail (or bubblewrap) jail -- own user, PID,
      mount, network, IPC and UTS namespaces, read-only system, no host files or environment --
      and every call additionally runs under the seccomp filter with a private /tmp.
    - ``seccomp``: workers run on the host; each call runs under the seccomp filter (no
      sockets, exec, new processes, ptrace, mounts, namespaces or signals to others),
      rlimits and a private working directory.  The host file system is NOT hidden.
    - ``none``: rlimits, private working directory and wall-clock deadline only. For trusted
      code and tests.
    - ``auto``: the strongest of the above that works on this host.
    """

    JAIL_SECCOMP = "jail+seccomp"
    SECCOMP = "seccomp"
    NONE = "none"
    AUTO = "auto"

    @property
    def rank(self) -> int:
        return {"none": 0, "seccomp": 1, "jail+seccomp": 2, "auto": -1}[self.value]


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The executor pool: how many zygotes, which isolation, and the per-call limits."""

    workers: int = 2
    """Zygote worker processes. Each forks one child per call and runs many children at once."""
    isolation: IsolationLevel = IsolationLevel.AUTO
    """Required isolation level; a level that cannot be had raises IsolationUnavailable."""
    jail: str = "auto"
    """Jail tool for ``jail+seccomp``: ``nsjail``, ``bwrap`` or ``auto`` (nsjail first)."""
    time_limit_s: float = 4.0
    """Default wall-clock limit per call, seconds (a request may set its own)."""
    max_time_limit_s: float = 60.0
    """Largest per-request time limit accepted; larger requests are capped to it."""
    memory_mb: int = 1024
    """Address space a call may allocate beyond what the zygote already maps (RLIMIT_AS)."""
    max_output_bytes: int = 65536
    """Cap per stream (stdout, stderr); head and tail are kept, the middle dropped."""
    max_processes: int = 256
    """Threads (and processes) the calls may start beyond the pool's own processes. Linux
    counts RLIMIT_NPROC per user, and every worker, template and call of a pool runs as one
    user (nobody under nsjail), so the limit set is this plus the pool's own
    (`process_budget`): at full load the pool's children alone no longer exhaust it."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE of a call: largest file it may write, MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE of a call."""
    tmp_mb: int = 256
    """Size of a jailed worker's /tmp tmpfs, MiB; the working directories of the calls one
    worker runs at once share it (each call also has RLIMIT_FSIZE per file)."""
    max_code_bytes: int = 1 << 20
    """Largest accepted ``code`` (and, separately, ``stdin``), bytes (UTF-8)."""
    queue_limit: int = 10000
    """Calls waiting for a worker slot beyond which ``execute`` raises Overloaded."""
    max_inflight_per_worker: int = 16
    """Children one zygote runs at once; calls beyond workers * this wait in the queue."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules every zygote imports at start (missing ones are reported, not fatal)."""
    light_preload: tuple[str, ...] = LIGHT_PRELOAD
    """Modules of a second, light template (spawner ``template`` only): a program that imports
    nothing else (as its text shows) forks from it, which is cheaper than forking from one
    that holds numpy and sympy. Empty: one template for every call."""
    python_paths: tuple[str, ...] = ()
    """Extra directories put on sys.path of the zygotes (bound read-only into the jail);
    needed for ``call_function`` targets outside site-packages. Workers run with ``-S``: no
    ``.pth`` file runs, so an editable install's source directory must be listed here."""
    function_max_result_bytes: int = 16 << 20
    """Largest pickled return value of a hosted function."""
    worker_start_timeout_s: float = 90.0
    """Time allowed for a zygote to import its preloads and report ready."""
    wedge_grace_s: float = 3.0
    """Beyond a call's limit, how long the pool waits before declaring its worker wedged."""
    spawner: str = "auto"
    """Who forks the children: ``template`` (a process that imports the preloads and then only
    forks, from a loop in C: no copy-on-write faults from bookkeeping, containment applied in
    C), ``python`` (the zygote forks from Python), or ``auto`` (template when its C module is
    built, else python)."""
    huge_pages: bool = True
    """Back the zygote heap with transparent huge pages: makes fork and exit ~2x cheaper."""

    @property
    def process_budget(self) -> int:
        """RLIMIT_NPROC of the workers, their templates and calls: `max_processes` above what
        the pool itself runs as that user, per worker its controller, two templates and up to
        `max_inflight_per_worker` calls. (It was `max_processes` alone: 16 workers x 16 calls
        plus their templates passed 256, and forks failed with EAGAIN at 90% load.) Other
        pools on the machine that run as the same user count against it too."""
        return self.max_processes + self.workers * (self.max_inflight_per_worker + 3)

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> SandboxConfigError:
            return SandboxConfigError(f"sandbox.{field}: {why}")

        for name in ("workers", "memory_mb", "max_output_bytes", "max_processes", "max_file_mb",
                     "max_open_files", "tmp_mb", "max_code_bytes", "queue_limit",
                     "max_inflight_per_worker", "function_max_result_bytes"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("time_limit_s", "max_time_limit_s", "worker_start_timeout_s", "wedge_grace_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise bad(name, f"must be a positive number of seconds, got {v}")
        if self.time_limit_s > self.max_time_limit_s:
            raise bad("time_limit_s", f"{self.time_limit_s} exceeds max_time_limit_s "
                                      f"{self.max_time_limit_s}")
        try:  # callers pass plain strings ("auto"); keep the enum from here on
            msgspec.structs.force_setattr(self, "isolation", IsolationLevel(self.isolation))
        except ValueError:
            raise bad("isolation", f"must be one of {[v.value for v in IsolationLevel]}, "
                                   f"got {self.isolation!r}") from None
        if self.jail not in ("auto", "nsjail", "bwrap"):
            raise bad("jail", f"must be 'auto', 'nsjail' or 'bwrap', got {self.jail!r}")
        if self.spawner not in ("auto", "template", "python"):
            raise bad("spawner", f"must be 'auto', 'template' or 'python', got {self.spawner!r}")
        if self.max_open_files < 8:
            raise bad("max_open_files", "must be >= 8 (stdio and Python need a few)")
