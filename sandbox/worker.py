"""The pool's handle on one zygote process: start it, send it calls, read its answers.

Owns the process, its three pipes and the jobs in flight on it; owns no policy (which worker
gets a job, when to replace a dead one: that is ``sandbox.pool``). All I/O is non-blocking on
the event loop (``add_reader``/``add_writer``), with writes coalesced per loop iteration so a
burst of calls costs one ``write`` syscall.
"""

from __future__ import annotations

import asyncio
import marshal
import os
import signal
import subprocess
import time
from collections.abc import Callable

import msgspec

from ._runtime import protocol
from .errors import ProtocolError, WorkerStartError

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_STDERR_KEEP = 8192


class Job:
    """One call in flight: its encoded frame, its future, and when it must have answered."""

    __slots__ = ("frame", "future", "hard_deadline", "id", "kind", "limit")

    def __init__(self, job_id: int, kind: int, frame: bytes, future: asyncio.Future,
                 limit: float) -> None:
        self.id = job_id
        self.kind = kind
        self.frame = frame
        self.future = future
        self.limit = limit
        self.hard_deadline = 0.0


class Worker:
    """One zygote. ``on_reply(job, msg)`` gets every answer; ``on_exit(worker)`` its death."""

    # set by start(); a Worker is used only after start() succeeded
    _proc: subprocess.Popen[bytes]
    _loop: asyncio.AbstractEventLoop
    _in_fd: int
    _out_fd: int
    _err_fd: int
    _ready_fut: asyncio.Future
    _exit_fut: asyncio.Future

    def __init__(self, index: int, argv: list[str], env: dict[str, str], config: dict,
                 on_reply: Callable[[Job, list], None],
                 on_exit: Callable[[Worker], None], cwd: str | None = None) -> None:
        self.index = index
        self.cwd = cwd
        self.argv = argv
        self.env = env
        self.config = config
        self.on_reply = on_reply
        self.on_exit = on_exit
        self.inflight: dict[int, Job] = {}
        self.info: dict = {}
        self.ready = False
        self.dead = False
        self.started_at = 0.0
        self.stderr_tail = bytearray()
        self._rbuf = bytearray()
        self._wbuf = bytearray()
        self._flush_scheduled = False
        self._writer_added = False
        self._spawned = False
        self._pidfd = -1
        self.exit_reason = ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._spawned else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float) -> dict:
        loop = self._loop = asyncio.get_running_loop()
        try:
            # Popen, not asyncio's subprocess transports: the pool reads and writes the raw
            # pipe fds itself (add_reader/add_writer), without per-message transport overhead.
            self._proc = subprocess.Popen(  # noqa: ASYNC220 -- fork+exec only, no waiting
                self.argv, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, close_fds=True, bufsize=0,
                cwd=self.cwd)
        except OSError as exc:
            raise WorkerStartError(f"cannot start worker {self.index}: {exc}") from exc
        self._spawned = True
        self.started_at = time.monotonic()
        assert self._proc.stdin and self._proc.stdout and self._proc.stderr
        self._in_fd = self._proc.stdin.fileno()
        self._out_fd = self._proc.stdout.fileno()
        self._err_fd = self._proc.stderr.fileno()
        for fd in (self._in_fd, self._out_fd, self._err_fd):
            os.set_blocking(fd, False)
        self._ready_fut = loop.create_future()
        self._exit_fut = loop.create_future()
        loop.add_reader(self._out_fd, self._on_stdout)
        loop.add_reader(self._err_fd, self._on_stderr)
        self._pidfd = os.pidfd_open(self._proc.pid)
        loop.add_reader(self._pidfd, self._on_process_exit)
        data = marshal.dumps(self.config)  # marshal: the zygote decodes it before importing
        # msgspec, so that the processes it forks children from do not map msgspec
        self._write(protocol.HEADER.pack(len(data)) + data)
        try:
            async with asyncio.timeout(timeout_s):
                self.info = await asyncio.shield(self._ready_fut)
        except TimeoutError:
            self.kill("did not report ready in time")
            raise WorkerStartError(f"worker {self.index} did not start within {timeout_s:g}s; "
                                   f"stderr: {self.stderr_text()}") from None
        except WorkerStartError:
            raise
        self.ready = True
        return self.info

    def stderr_text(self) -> str:
        return self.stderr_tail.decode("utf-8", "replace").strip()[-2000:]

    def kill(self, reason: str) -> None:
        """SIGKILL the worker's process group; ``on_exit`` follows once it is gone."""
        if not self.exit_reason:
            self.exit_reason = reason
        if self._spawned and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except OSError:
                pass

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Close stdin (the zygote kills its children and exits), then make sure it is gone."""
        if not self._spawned or self.dead:
            return
        self.exit_reason = self.exit_reason or "stopped"
        if self._writer_added:
            self._loop.remove_writer(self._in_fd)
            self._writer_added = False
        self._in_fd = -1
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # EOF: the zygote kills its children and exits
        except OSError:
            pass
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._exit_fut)
        except TimeoutError:
            self.kill("did not stop in time")
            await asyncio.shield(self._exit_fut)

    async def wait_exit(self) -> None:
        if self._spawned:
            await asyncio.shield(self._exit_fut)

    # ------------------------------------------------------------------ sending
    def submit(self, job: Job, now: float) -> None:
        job.hard_deadline = now + job.limit
        self.inflight[job.id] = job
        self._write(job.frame)

    def cancel(self, job_id: int) -> None:
        if job_id in self.inflight and not self.dead:
            data = _encoder.encode([job_id, protocol.KIND_CANCEL])
            self._write(protocol.HEADER.pack(len(data)) + data)

    def _write(self, data: bytes) -> None:
        if self.dead:
            return
        self._wbuf += data
        if not self._flush_scheduled and not self._writer_added:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.dead or not self._wbuf or self._in_fd < 0:
            return
        fd = self._in_fd
        try:
            n = os.write(fd, self._wbuf)
            del self._wbuf[:n]
        except BlockingIOError:
            pass
        except OSError as exc:  # the worker went away; its death is handled by _on_stdout
            self._wbuf.clear()
            self.kill(f"write to worker failed: {exc}")
            return
        if self._wbuf and not self._writer_added:
            self._loop.add_writer(fd, self._on_writable)
            self._writer_added = True

    def _on_writable(self) -> None:
        self._loop.remove_writer(self._in_fd)
        self._writer_added = False
        self._flush()

    # ------------------------------------------------------------------ receiving
    def _on_stdout(self) -> None:
        fd = self._out_fd
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._loop.remove_reader(fd)
            self.kill("worker closed its output")
            return
        self._rbuf += chunk
        try:
            frames = protocol.split_frames(self._rbuf)
            for frame in frames:
                msg = _decoder.decode(frame)
                job_id = msg[0]
                if job_id == 0:
                    self._control(msg)
                    continue
                job = self.inflight.pop(job_id, None)
                if job is not None:
                    self.on_reply(job, msg)
        except (ValueError, msgspec.DecodeError, IndexError, TypeError) as exc:
            self.kill(f"undecodable message from worker: {exc!r}")
            if not self._ready_fut.done():
                self._ready_fut.set_exception(ProtocolError(str(exc)))

    def _control(self, msg: list) -> None:
        if msg[1] == "ready" and not self._ready_fut.done():
            self._ready_fut.set_result(msg[2])

    def _on_stderr(self) -> None:
        fd = self._err_fd
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._loop.remove_reader(fd)
            return
        self.stderr_tail += chunk
        if len(self.stderr_tail) > _STDERR_KEEP:
            del self.stderr_tail[:-_STDERR_KEEP]

    def _on_process_exit(self) -> None:
        loop = self._loop
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        # The pidfd fires when our direct child (nsjail / the zygote) exits. Kill whatever is
        # left of its process group *before* reaping it: until then the zombie holds the group
        # id, so the id cannot have been reused by an unrelated process group.
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=0)
        except subprocess.TimeoutExpired:  # cannot happen after the pidfd fired; keep going
            pass
        self._on_stderr()
        self.dead = True
        self.ready = False
        if not self.exit_reason:
            self.exit_reason = f"worker exited with status {self._proc.returncode}"
        for fd in (self._out_fd, self._err_fd):
            loop.remove_reader(fd)
        if self._writer_added and self._in_fd >= 0:
            loop.remove_writer(self._in_fd)
            self._writer_added = False
        for f in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if not self._ready_fut.done():
            self._ready_fut.set_exception(WorkerStartError(
                f"worker {self.index} exited during start-up ({self.exit_reason}); "
                f"stderr: {self.stderr_text()}"))
        if not self._exit_fut.done():
            self._exit_fut.set_result(None)
        self.on_exit(self)

    def take_inflight(self) -> list[Job]:
        jobs = list(self.inflight.values())
        self.inflight.clear()
        return jobs


def oldest_overdue(worker: Worker, now: float, grace: float) -> Job | None:
    """The first job past its deadline plus ``grace`` (the zygote should have killed it)."""
    for job in worker.inflight.values():
        if now > job.hard_deadline + grace:
            return job
    return None

