"""The controller: the zygote's event loop, which turns the pool's requests into children and
their ends into answers.

Owns start-up's order (``Controller.prepare``: fork the templates -- or, in the Python shape,
prepare this process -- and only then import what serving needs), the single-threaded epoll
loop (requests on fd 0, answers on fd 1, per child its stdout/stderr/status pipes, per
template its socket, in the Python shape per child a pidfd), the wall-clock deadlines, the
routing of a program to the light or the main template (``light_enough``), cancellation, and
shutdown. Every child has a deadline; past it the child is SIGKILLed with its process group
(by its template, which alone reaps it, so a pid is never reused under a kill).

Does not own what the process children fork from does (``template``), the per-call resources
and answers (``children``), or anything a child runs (``child``); it runs no model code.

msgspec, epoll (``select``) and ``socket`` are imported by ``_controller_modules``, after the
templates were forked, never at module level: this module is loaded in the process that forks
them (see ``template`` for why they must not map these).
"""

from __future__ import annotations

import os
import re
import signal
import struct
import time
from typing import TYPE_CHECKING, Any, NoReturn

from . import child as childmod
from . import children, protocol, template
from .children import Child, Prepared
from .outcome import Stream

if TYPE_CHECKING:
    import heapq
    import select
    import socket

    import msgspec

_encoder: msgspec.msgpack.Encoder
_decoder: msgspec.msgpack.Decoder


def _controller_modules() -> None:
    global heapq, msgspec, select, socket, _encoder, _decoder
    import heapq
    import select
    import socket

    import msgspec
    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder()


_READ = 65536
# the C side's structs (see _forkserver.c): request and reply
_REQUEST = struct.Struct("=IIQdII")
_REPLY = struct.Struct("=IiQ")
_OP_SPAWN, _OP_KILL = 1, 2
_OP_SPAWNED, _OP_EXITED = 1, 2
_FLAG_SECCOMP, _FLAG_LANDLOCK = 1, 2


class _Template:
    """The controller's handle on a template: its socket, pid, queued requests, and what its
    self-tests showed working."""

    __slots__ = ("landlock", "name", "pid", "seccomp", "sends", "sock")

    def __init__(self, name: str, sock: Any, pid: int, info: dict) -> None:
        self.name = name
        self.sock = sock  # an fd until serving starts, then a non-blocking socket object
        self.pid = pid
        self.sends: list[tuple[bytes, list[int], list[int]]] = []
        self.seccomp = bool(info.get("seccomp"))  # what its self-tests showed working
        self.landlock = bool(info.get("landlock"))


_IMPORT_RE = re.compile(r"\bimport\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)"
                        r"|\bfrom\s+([\w.]+)\s+import\b")
_DYNAMIC_IMPORT = ("__import__", "importlib", "exec(", "eval(")


def light_enough(code: str, light: frozenset[str]) -> bool:
    """Whether a program may run in the light template: every module it imports (as far as
    the text shows) is one the light template has loaded, and it imports nothing dynamically.
    Only a speed matter: a program routed wrongly still runs, importing what it lacks."""
    if any(d in code for d in _DYNAMIC_IMPORT):
        return False
    for m in _IMPORT_RE.finditer(code):
        if m.group(2) is not None:
            names = [m.group(2)]
        else:
            names = [part.split()[0] for part in m.group(1).split(",")]
        for name in names:
            if name.split(".")[0] not in light:
                return False
    return True


class Controller:
    """One worker's controller: ``prepare``, then ``serve`` until the pool closes fd 0."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.index = int(cfg["index"])
        self.max_output = int(cfg["max_output_bytes"])
        self.max_result = int(cfg["function_max_result_bytes"])
        self.workroot: str = cfg.get("workroot") or "/tmp"
        self.runtime: template.Runtime | None = None  # the Python shape: this process forks
        self.children: dict[int, Child] = {}
        self.by_fd: dict[int, tuple[Child, Stream | None]] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.ep: select.epoll  # by prepare()
        self.inbuf = bytearray()
        # Answers are buffered here and written with os.write, never through sys.stdout: a
        # child forked from this process (the Python shape) reuses sys.stdout as its own
        # output, and would flush whatever answers sat unflushed in its buffer at the fork
        # (other calls' results) into its own stdout.
        self._outbuf = bytearray()
        self.info: dict = {}
        self.templates: list[_Template] = []  # [main, light]: the C fork loops, if used
        self.template_by_fd: dict[int, _Template] = {}
        self.light_modules: frozenset[str] = frozenset()
        self._rbuf = bytearray(_REPLY.size)
        self._devnull = -1  # by prepare(): stdin of the calls that have none

    # ---------------------------------------------------------------- start-up
    def prepare(self) -> None:
        """Get ready to fork children: in template processes when the C fork loop is there
        (the default), else in this process. Then load what the controller needs to serve."""
        want = self.cfg.get("spawner", "auto")
        if want != "python" and template.HAVE_FORKSERVER:
            self.info = self._start_template(
                "main", [*self.cfg.get("preload", []), *childmod.FUNCTION_MODULES])
            light = list(self.cfg.get("light_preload") or [])
            if light:
                info = self._start_template("light", light)
                self.light_modules = frozenset(info["modules"])
                self.info["light"] = {k: info.get(k) for k in (
                    "pid", "vm_bytes", "startup_s", "thp_kb", "missing_preload", "seccomp",
                    "seccomp_split", "landlock")}
                if bool(info.get("seccomp")) != bool(self.info.get("seccomp")) or bool(
                        info.get("landlock")) != bool(self.info.get("landlock")):
                    raise RuntimeError(f"the templates' containment differs: main {self.info}, "
                                       f"light {info}")
            self.info.update(spawner="template", controller_pid=os.getpid())
        elif want == "template":
            raise RuntimeError(f"spawner 'template' asked for, but the C fork loop is not "
                               f"available: {template.FORKSERVER_ERROR}")
        else:
            self.runtime = template.Runtime(self.cfg)
            self.runtime.prepare([*self.cfg.get("preload", []), *childmod.FUNCTION_MODULES])
            self.info = self.runtime.info
            self.info["spawner"] = "python"
            self.info["spawner_note"] = template.FORKSERVER_ERROR or "asked for"
        template.make_undumpable()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        _controller_modules()
        self.ep = select.epoll()
        for t in self.templates:
            fd = t.sock
            t.sock = socket.socket(fileno=fd)
            t.sock.setblocking(False)
            self.template_by_fd[fd] = t
            self.ep.register(fd, select.EPOLLIN)

    def _start_template(self, name: str, preload: list[str]) -> dict:
        fd, pid, info = template.start_template(self.cfg, name, preload,
                                                [t.sock for t in self.templates])
        self.templates.append(_Template(name, fd, pid, info))
        return info

    # ---------------------------------------------------------------- serving
    def send(self, obj) -> None:
        """Queue a frame to the pool; `serve` flushes once per loop iteration (one write, and
        one wake-up of the pool, for every answer that iteration produced)."""
        data = _encoder.encode(obj)
        self._outbuf += protocol.HEADER.pack(len(data)) + data

    def flush(self) -> None:
        out = self._outbuf
        while out:  # fd 1 is a blocking pipe: each write blocks until some of it went
            del out[:os.write(1, out)]

    def serve(self) -> None:
        os.set_blocking(0, False)
        self.ep.register(0, select.EPOLLIN)
        self._handle([_decoder.decode(f) for f in protocol.split_frames(self.inbuf)])
        while True:
            timeout = -1.0
            if self.deadlines:
                timeout = max(0.0, self.deadlines[0][0] - time.monotonic())
            try:
                events = self.ep.poll(timeout)
            except InterruptedError:
                continue
            # Resolve every event to its owner *before* handling any: handling one can close
            # fds whose numbers a call spawned in the same round then reuses, and a stale event
            # must not be taken for the new owner's (a stdout event read as "this new child
            # exited" would finalize -- kill -- a child that is still starting).
            owned = [(fd, self.by_fd.get(fd)) for fd, _ in events]
            for fd, entry in owned:
                t = self.template_by_fd.get(fd)
                if t is not None:
                    if t.sends:
                        self._flush_sends(t)
                    self._read_replies(t)
                    continue
                if fd == 0:
                    if not self._read_requests():
                        self.shutdown()
                        return
                    continue
                if entry is None:
                    continue
                ch, stream = entry
                if stream is None:
                    if self.children.get(ch.id) is ch:
                        self._finalize(ch)
                elif stream.open:
                    self._read_stream(ch, stream)
            if self.deadlines:
                self._expire(time.monotonic())
            self.flush()

    def _read_requests(self) -> bool:
        while True:
            try:
                chunk = os.read(0, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                return False
            self.inbuf += chunk
        self._handle([_decoder.decode(f) for f in protocol.split_frames(self.inbuf)])
        return True

    def _handle(self, msgs: list[list]) -> None:
        calls = []
        for msg in msgs:
            if msg[1] == protocol.KIND_CANCEL:
                ch = self.children.get(msg[0])
                if ch is not None and not ch.cancelled:
                    ch.cancelled = True
                    self._kill(ch)
            else:
                calls.append(msg)
        if calls:
            self._spawn_batch(calls)

    def _spawn_batch(self, msgs: list[list]) -> None:
        """Prepare every call, fork them back to back, then do the bookkeeping.

        Each fork write-protects the whole heap again, so every page the zygote touches
        between two forks costs it a copy-on-write fault. Forking a burst in a tight loop and
        registering afterwards pays the bookkeeping's faults once per burst, not per call.
        """
        prepared = [p for p in map(self._prepare, msgs) if p is not None]
        if self.templates:
            for p in prepared:
                self._send_spawn(p)
            for t in self.templates:
                if t.sends:
                    self._flush_sends(t)
            return
        runtime = self.runtime
        assert runtime is not None  # no templates: this process was prepared to fork
        started = []
        for p in prepared:
            started.append((p, *runtime.fork_child(p)))
        for p, pid, t0 in started:
            self._register(p, pid, t0)

    def _prepare(self, msg: list) -> Prepared | None:
        req_id, kind, text, data, limit = msg[0], msg[1], msg[2], msg[3], float(msg[4])
        ch = Child(req_id, kind, limit, msg[5] if len(msg) > 5 else "")
        landlock = self.runtime is not None and self.runtime.landlock_rules is not None
        try:
            return children.prepare(
                ch, text, data, index=self.index, workroot=self.workroot, devnull=self._devnull,
                max_output=self.max_output, max_result=self.max_result,
                workdir_fd=landlock or bool(self.templates), payload=bool(self.templates))
        except OSError as exc:
            self._answer_failure(ch, f"could not prepare the call: {exc}")
            return None

    def _track(self, ch: Child, streams: list[Stream], start: float) -> None:
        """From now on ``ch`` is running: its output is read, its deadline watched."""
        ch.start = start
        ch.deadline = start + ch.limit
        self.children[ch.id] = ch
        for s in streams:
            os.set_blocking(s.fd, False)
            ch.streams.append(s)
            self.by_fd[s.fd] = (ch, s)
            self.ep.register(s.fd, select.EPOLLIN)
        heapq.heappush(self.deadlines, (ch.deadline, ch.id))

    # ---------------------------------------------------------------- template shape
    def _send_spawn(self, p: Prepared) -> None:
        ch = p.child
        flags = 0
        which = 0  # the main template
        if ch.kind == protocol.KIND_EXEC:
            if len(self.templates) > 1 and light_enough(p.text, self.light_modules):
                which = 1
            if self.templates[which].seccomp:
                flags |= _FLAG_SECCOMP
        t = self.templates[which]
        if t.landlock:
            flags |= _FLAG_LANDLOCK
        ch.template = which
        msg = _REQUEST.pack(_OP_SPAWN, ch.kind, ch.id, ch.limit, flags, ch.payload_len)
        t.sends.append((msg, list(p.fds), p.to_close))
        self._track(ch, p.streams, time.monotonic())

    def _flush_sends(self, t: _Template) -> None:
        sent = 0
        try:
            for msg, fds, to_close in t.sends:
                t.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        struct.pack(f"{len(fds)}i", *fds))] if fds else [])
                sent += 1
                for fd in to_close:
                    os.close(fd)
        except BlockingIOError:
            pass
        except OSError as exc:  # the template is gone: the controller cannot go on
            self._template_lost(f"send to the {t.name} template failed: {exc!r}")
        del t.sends[:sent]
        self.ep.modify(t.sock.fileno(), select.EPOLLIN | (select.EPOLLOUT if t.sends else 0))

    def _send_kill(self, ch: Child) -> None:
        assert ch.template >= 0  # `_kill` sends here only when templates fork the children
        t = self.templates[ch.template]
        t.sends.append((_REQUEST.pack(_OP_KILL, 0, ch.id, 0.0, 0, 0), [], []))
        self._flush_sends(t)

    def _read_replies(self, t: _Template) -> None:
        buf = self._rbuf
        while True:
            try:
                n = t.sock.recv_into(buf, _REPLY.size)
            except BlockingIOError:
                return
            except OSError as exc:
                self._template_lost(f"reading from the {t.name} template failed: {exc!r}")
            if n == 0:
                self._template_lost(f"the {t.name} template exited")
            if n != _REPLY.size:
                self._template_lost(f"malformed reply of {n} bytes from the {t.name} template")
            op, value, call_id = _REPLY.unpack_from(buf)
            ch = self.children.get(call_id)
            if ch is None:
                continue
            if op == _OP_SPAWNED:
                if value < 0:
                    del self.children[call_id]
                    for st in ch.streams:
                        self._close_stream(ch, st)
                    children.remove_tree(ch.workdir)
                    self._answer_failure(ch, f"fork failed: {os.strerror(-value)}")
            elif op == _OP_EXITED:
                self._finalize(ch, value)

    def _template_lost(self, why: str) -> NoReturn:
        """Without its template the worker cannot run calls: exit; the pool fails the calls
        in flight with sandbox_failure and starts a new worker."""
        os.write(2, f"sandbox zygote: {why}\n".encode())
        self.flush()  # the answers already made still reach the pool
        for t in self.templates:
            try:
                os.kill(t.pid, signal.SIGKILL)
            except OSError:
                pass
        self.shutdown(remove_root=False)  # the pool goes on: its replacement worker uses it
        os._exit(3)

    # ---------------------------------------------------------------- Python shape
    def _register(self, p: Prepared, pid: int, t0: float) -> None:
        ch = p.child
        if pid < 0:
            children.release(ch, p.to_close, p.streams)
            self._answer_failure(ch, "fork failed (out of memory or pids?)")
            return
        for fd in p.to_close:
            os.close(fd)
        ch.pid = pid
        ch.pidfd = os.pidfd_open(pid)
        self.by_fd[ch.pidfd] = (ch, None)
        self.ep.register(ch.pidfd, select.EPOLLIN)
        self._track(ch, p.streams, t0)

    # ---------------------------------------------------------------- a child's end
    def _read_stream(self, ch: Child, s: Stream) -> None:
        try:
            chunk = os.read(s.fd, _READ)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            s.feed(chunk)
        else:
            self._close_stream(ch, s)

    def _close_stream(self, ch: Child, s: Stream) -> None:
        # fd numbers are reused by later children as soon as they are closed: track the
        # stream's own state, never "is this fd number registered"
        if s.open:
            s.open = False
            del self.by_fd[s.fd]
            self.ep.unregister(s.fd)
            os.close(s.fd)

    def _kill(self, ch: Child) -> None:
        if self.templates:
            self._send_kill(ch)
            return
        try:
            os.killpg(ch.pid, signal.SIGKILL)  # the child is its own group leader (setsid)
        except OSError:
            pass
        try:
            os.kill(ch.pid, signal.SIGKILL)  # before setsid ran, the group is the zygote's
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self.deadlines)
            ch = self.children.get(req_id)
            if ch is not None and not ch.timed_out:
                ch.timed_out = True
                self._kill(ch)

    def _finalize(self, ch: Child, status: int | None = None) -> None:
        """The child's thread group is gone (pidfd readable, or the template reaped it and
        sent its wait ``status``): drain, reap, answer."""
        if status is None:
            self._kill(ch)  # what is left of its group (a hosted function may fork) dies too
        for s in ch.streams:
            if not s.open:
                continue
            while True:
                try:
                    chunk = os.read(s.fd, _READ)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                s.feed(chunk)
            self._close_stream(ch, s)
        if status is None:
            _, status = os.waitpid(ch.pid, 0)
            self.ep.unregister(ch.pidfd)
            del self.by_fd[ch.pidfd]
            os.close(ch.pidfd)
        duration = time.monotonic() - ch.start
        del self.children[ch.id]
        children.remove_tree(ch.workdir)
        self.send(children.answer(ch, os.waitstatus_to_exitcode(status), duration))

    def _answer_failure(self, ch: Child, detail: str) -> None:
        self.send(children.failure(ch, detail))

    # ---------------------------------------------------------------- exit
    def shutdown(self, remove_root: bool = True) -> None:
        """Kill and reap every child, remove their working directories (and, the last of the
        pool's workers to go, the pool's temporary root)."""
        if self.templates:
            # EOF: a template kills and reaps every child of its own, then exits
            for t in self.templates:
                t.sock.close()
            for t in self.templates:
                try:
                    os.waitpid(t.pid, 0)
                except ChildProcessError:
                    pass
            self.templates = []
            for ch in list(self.children.values()):
                if ch.workdir:
                    children.remove_tree(ch.workdir)
            self.children.clear()
            if remove_root:
                try:
                    os.rmdir(self.workroot)
                except OSError:
                    pass
            return
        for ch in list(self.children.values()):
            self._kill(ch)
        for ch in list(self.children.values()):
            try:
                os.waitpid(ch.pid, 0)
            except ChildProcessError:
                pass
            if ch.workdir:
                children.remove_tree(ch.workdir)
        try:  # the pool's temporary root: the last of its workers to go removes it
            os.rmdir(self.workroot)
        except OSError:
            pass
