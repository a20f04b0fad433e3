"""A call's child as the controller sees it: its record, the resources made for it, its answer.

Owns ``Child`` (one call in flight: kind, deadline, captured streams, working directory), the
per-call resources the controller makes before a fork (``prepare``: stdin memfd, output and
status pipes, the working directory, in the template shape the payload memfd) and releases
after it (``release``, ``remove_tree``), and the answer frames a finished or failed child
becomes (``answer``, ``failure``; the status rules themselves are in ``outcome``).

Does not own forking (``template``), the event loop that reads the pipes and watches the
deadlines (``controller``), or what runs inside the child (``child``). Plain ``os`` calls
only: ``remove_tree`` also runs in the process children fork from (a self-test's directory),
which must not map more than it needs (see ``template``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from . import outcome, protocol
from .outcome import Stream


class Child:
    """One call from the moment it is prepared until its answer is sent."""

    __slots__ = (
        "cancelled",
        "deadline",
        "id",
        "kind",
        "limit",
        "note",
        "payload_len",
        "pid",
        "pidfd",
        "start",
        "streams",
        "template",
        "timed_out",
        "workdir",
    )

    def __init__(self, req_id: int, kind: int, limit: float, note: str) -> None:
        self.id = req_id
        self.kind = kind
        self.limit = limit
        self.note = note
        self.timed_out = False
        self.cancelled = False
        self.workdir = ""
        self.pid = 0
        self.pidfd = -1
        self.start = 0.0
        self.deadline = 0.0
        self.streams: list[Stream] = []
        self.template = -1  # which of the controller's templates forked it (0 main, 1 light)
        self.payload_len = 0


class Prepared(NamedTuple):
    """A call ready to fork: what the child gets, and what the controller closes after."""

    child: Child
    fds: tuple[int, ...]  # handed to the child: stdin, stdout, stderr, status (+ payload, workdir)
    to_close: list[int]  # the child's ends, closed here once it has them
    streams: list[Stream]  # the controller's ends: output (and log) pipes, then status
    workdir_fd: int  # O_PATH fd of the working directory, or -1
    text: str  # the program, or the hosted function's target
    data: bytes  # stdin, or the pickled arguments


def prepare(ch: Child, text: str, data: bytes, *, index: int, workroot: str, devnull: int,
            max_output: int, max_result: int, workdir_fd: bool, payload: bool) -> Prepared:
    """Make the pipes, memfds and working directory of one call. ``workdir_fd``: open the
    directory O_PATH (Landlock, or the template, needs it); ``payload``: put the call in a
    memfd (the template reads it from there). On OSError what was made is released."""
    kind = ch.kind
    fds_to_close: list[int] = []
    streams: list[Stream] = []
    try:
        if kind == protocol.KIND_EXEC:
            if data:
                stdin_fd = os.memfd_create("stdin", 0)
                fds_to_close.append(stdin_fd)
                write_all(stdin_fd, data)
                os.lseek(stdin_fd, 0, os.SEEK_SET)
            else:  # no input: the shared /dev/null (a memfd per call costs two syscalls)
                stdin_fd = devnull
            out_r, out_w = os.pipe()
            streams.append(Stream(out_r, max_output))
            fds_to_close.append(out_w)
            err_r, err_w = os.pipe()
            streams.append(Stream(err_r, max_output))
            fds_to_close.append(err_w)
            child_fds = (stdin_fd, out_w, err_w)
        else:
            stdin_fd = devnull
            log_r, log_w = os.pipe()
            streams.append(Stream(log_r, 8192))
            fds_to_close.append(log_w)
            child_fds = (stdin_fd, log_w, log_w)
        st_r, st_w = os.pipe()
        streams.append(Stream(st_r, max_result + 1))
        fds_to_close.append(st_w)
        ch.workdir = os.path.join(workroot, f"w{index}-{ch.id}")
        os.mkdir(ch.workdir, 0o700)
        wfd = -1
        if workdir_fd:
            wfd = os.open(ch.workdir, os.O_PATH)
            fds_to_close.append(wfd)
        extra: tuple[int, ...] = ()
        if payload:
            payload_fd = os.memfd_create("payload", 0)
            fds_to_close.append(payload_fd)
            raw = text.encode("utf-8", "surrogatepass")
            body = (len(raw).to_bytes(8, "little") + raw
                    + (data if kind != protocol.KIND_EXEC else b""))
            write_all(payload_fd, body)
            ch.payload_len = len(body)
            extra = (payload_fd, wfd)
    except OSError:
        release(ch, fds_to_close, streams)
        raise
    fds = (*child_fds, st_w, *extra) if payload else (*child_fds, st_w)
    return Prepared(ch, fds, fds_to_close, streams, wfd, text, data)


def release(ch: Child, fds: list[int], streams: list[Stream]) -> None:
    """Undo ``prepare`` for a call that will not run: close its fds, remove its directory."""
    for fd in [*fds, *(s.fd for s in streams)]:
        try:
            os.close(fd)
        except OSError:
            pass
    if ch.workdir:
        remove_tree(ch.workdir)


def answer(ch: Child, code: int, duration: float) -> list:
    """The answer frame of a child that exited with ``code`` (``os.waitstatus_to_exitcode``)
    after its streams were drained: the last stream is the status pipe."""
    streams = ch.streams
    st = streams[-1].data()
    if ch.kind == protocol.KIND_EXEC:
        out, err = streams[0], streams[1]
        stderr = err.data().decode("utf-8", "replace")
        status, code_out, detail = outcome.exec_outcome(
            code, setup_ok=st.startswith(b"R"), timed_out=ch.timed_out, cancelled=ch.cancelled,
            limit_s=ch.limit, note=ch.note, stderr=stderr)
        return [ch.id, status, out.data().decode("utf-8", "replace"), stderr, code_out,
                duration, out.truncated or err.truncated, detail]
    status, payload, detail = outcome.call_outcome(
        code, st, timed_out=ch.timed_out, cancelled=ch.cancelled, limit_s=ch.limit,
        log=streams[0].data().decode("utf-8", "replace"))
    return [ch.id, status, payload, detail, duration]


def failure(ch: Child, detail: str) -> list:
    """The answer frame of a call the sandbox could not run (nothing of the call's doing)."""
    if ch.kind == protocol.KIND_EXEC:
        return [ch.id, "sandbox_failure", "", "", None, 0.0, False, detail]
    return [ch.id, "sandbox_failure", None, detail, 0.0]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def remove_tree(path: str) -> None:
    """Remove a call's working directory and whatever the call left in it (os only: shutil
    would map compression libraries into every process the children are forked from)."""
    try:
        os.rmdir(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    try:
        os.chmod(path, 0o700)  # a call may have made its directories unreadable or read-only
    except OSError:
        pass
    try:
        entries = list(os.scandir(path))
    except OSError:
        entries = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                remove_tree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass
