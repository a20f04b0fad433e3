"""The zygote: one worker of the pool, which forks one contained child per call.

Two shapes, one protocol towards the pool (``protocol``):

- **Templates** (``spawner = template``, the default when the C module ``_forkserver`` is
  built). This process is the *controller*: it reads the config, forks a *main template*
  (every preload) and a *light template* (``light_preload``: the standard library's common
  pure-Python modules), and only then imports what serving needs (msgspec, epoll, sockets), so
  the templates do not map them. A template imports its preloads, warms them up, freezes its
  heap, prepares the Landlock ruleset and the seccomp program, self-tests them, and enters
  ``_forkserver.serve``: a loop in C that forks on request, applies the containment in C and
  returns into Python only in the child, with the call. The controller does all per-call
  bookkeeping (working directories, pipes, deadlines, output capture, answers); the templates
  write nothing between forks. Why: on this machine (nested virtualisation) a page fault costs
  ~4 us, and a zygote that forks from its own Python loop re-faults ~190 pages per call, its
  children ~200 more while containing themselves in Python; every memory region of the forked
  process also costs ~1.8 us per fork and exit (the light template maps ~100, the main one
  ~330). A program goes to the light template when the imports its text shows are all loaded
  there (``light_enough``); anything else, and every hosted function, to the main one.
- **Python** (``spawner = python``, or no C module): this process imports the preloads and
  forks each child itself (glibc ``fork`` through ctypes); the child contains itself
  (``child.setup``). Same containment, same answers, about half the throughput.

Lifecycle: read the config frame (marshal) on stdin, prepare (above), report ready, serve. The
loop is a single-threaded epoll loop: requests from the pool on fd 0, answers on fd 1, per
child its stdout/stderr/status pipes, and per template its socket (or, in the Python shape,
per child a pidfd). Every child has a wall-clock deadline; past it the child is SIGKILLed
(with its process group; by its template, which alone reaps it, so a pid is never reused
under a kill). Neither the controller nor a template runs model code. How a finished child
becomes an answer is in ``outcome``, the warm-up and huge-page work in ``warm``, the child's
own steps in ``child``.

Exit: EOF on stdin (the pool went away or closed us) -> kill every child and exit. A template
that dies takes its worker down (the pool fails that worker's calls in flight and starts a new
one).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import marshal
import os
import random
import re
import resource
import signal
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

from . import child as childmod
from . import landlock, outcome, protocol, seccomp, warm
from .outcome import Stream

try:  # the template's fork loop in C; without it the zygote forks from Python (slower)
    from . import _forkserver  # type: ignore[attr-defined]  # built by pip, maybe absent
    _FORKSERVER_ERROR = ""
except ImportError as _exc:
    _forkserver = None
    _FORKSERVER_ERROR = repr(_exc)[:300]

if TYPE_CHECKING:
    import heapq
    import select
    import socket

    import msgspec

# Imported by `_controller_modules`, after the templates were forked: the process children
# fork from must not map msgspec, sockets or epoll (each shared library is ~5 memory regions,
# and every region costs every fork and every exit).
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
_libc = ctypes.CDLL(None, use_errno=True)
_READ = 65536
_PR_SET_DUMPABLE = 4
# the C side's structs (see _forkserver.c): request and reply
_REQUEST = struct.Struct("=IIQdII")
_REPLY = struct.Struct("=IiQ")
_OP_SPAWN, _OP_KILL = 1, 2
_OP_SPAWNED, _OP_EXITED = 1, 2
_FLAG_SECCOMP, _FLAG_LANDLOCK = 1, 2


class _Child:
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
        self.template: _Template | None = None
        self.payload_len = 0


class _Template:
    """A process that imported its preloads and then only forks, from the C loop."""

    __slots__ = ("landlock", "name", "pid", "seccomp", "sends", "sock")

    def __init__(self, name: str, sock: Any, pid: int, info: dict) -> None:
        self.name = name
        self.sock = sock
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


class Zygote:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.index = int(cfg["index"])
        self.max_output = int(cfg["max_output_bytes"])
        self.max_result = int(cfg["function_max_result_bytes"])
        self.workroot: str = cfg.get("workroot") or "/tmp"
        self.landlock_rules: landlock.Ruleset | None = None
        self._np_rand = None
        self.drop_caps = False
        self.seccomp_filter: seccomp.Filter | None = None  # what each exec child installs
        self.template_filter: seccomp.Filter | None = None  # split filter: the template's half
        self.limits = childmod.Limits(0, 0)  # set by prepare()
        self.children: dict[int, _Child] = {}
        self.by_fd: dict[int, tuple[_Child, Stream | None]] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.ep: select.epoll  # by prepare()
        self.inbuf = bytearray()
        self.out = sys.stdout.buffer
        self.info: dict = {}
        self.templates: list[_Template] = []  # [main, light]: the C fork loops, if used
        self.template_by_fd: dict[int, _Template] = {}
        self.light_modules: frozenset[str] = frozenset()
        self._rbuf = bytearray(_REPLY.size)
        self._reseed_in_python = True
        self._devnull = -1  # by prepare(): stdin of the calls that have none
        self._unflushed = False

    # ---------------------------------------------------------------- start-up
    def prepare(self) -> None:
        """Get ready to fork children: in template processes when the C fork loop is there
        (the default), else in this process. Then load what the controller needs to serve."""
        want = self.cfg.get("spawner", "auto")
        if want != "python" and _forkserver is not None:
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
                               f"available: {_FORKSERVER_ERROR}")
        else:
            self._prepare_runtime([*self.cfg.get("preload", []), *childmod.FUNCTION_MODULES])
            self.info["spawner"] = "python"
            self.info["spawner_note"] = _FORKSERVER_ERROR or "asked for"
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
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
        """Fork a template: it imports ``preload`` and then only forks, in C; this process
        (the controller) keeps every piece of per-call bookkeeping, so nothing it does writes
        to pages that the children share with the process they are forked from."""
        assert _forkserver is not None
        ours, theirs = _forkserver.seqpacket_pair()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ours)
                for t in self.templates:
                    os.close(t.sock)
                self._template_main(theirs, preload, light=name == "light")
            except BaseException as exc:  # broad: report, then die; the controller sees EOF
                try:
                    os.write(2, f"sandbox template failed: {exc!r}\n".encode())
                except OSError:
                    pass
            os._exit(childmod.EXIT_SETUP_FAILED)
        os.close(theirs)
        data = os.read(ours, 1 << 20)
        if not data:
            _, status = os.waitpid(pid, 0)
            raise RuntimeError(f"the {name} template exited during start-up (status {status})")
        info = marshal.loads(data)
        self.templates.append(_Template(name, ours, pid, info))
        return info

    def _template_main(self, sock: int, preload: list[str], light: bool) -> None:
        """In the template: prepare, report, then fork on request (returns only in children)."""
        assert _forkserver is not None
        _libc.prctl(childmod._PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)  # the pool's pipes belong to the controller alone
        os.dup2(devnull, 1)
        os.close(devnull)
        # The light template runs only model-written programs, so it can live under the
        # template half of the filter itself; the main one also hosts functions, which run
        # without seccomp.
        self._prepare_runtime(preload, split_seccomp=light)
        self.info["fork"] = "template"
        rules, prog = self.landlock_rules, self.seccomp_filter
        cfg = {
            "landlock_attr": rules.attr if rules is not None else None,
            "landlock_rules": rules.rules if rules is not None else [],
            "landlock_workdir_access": rules.workdir_access if rules is not None else 0,
            "seccomp_prog": bytes(prog.prog) if prog is not None else None,
            "seccomp_slots": list(prog.slots) if prog is not None else [],
            "as_bytes": self.limits.as_bytes, "nofile": self.limits.nofile,
            "drop_caps": self.drop_caps, "nice": childmod.CHILD_NICE,
        }
        cfg["reseed"], self._reseed_in_python = self._mt_states()
        self.info["reseed"] = "c" if not self._reseed_in_python else "python"
        # What every call's run_program would otherwise set up itself, done once here: each
        # child starts from a pristine copy of it (fork), without writing a page for it.
        childmod.prepare_main()
        gc.collect()
        gc.freeze()
        childmod.pause_gc()
        if self.template_filter is not None:
            self.template_filter.install()
        os.write(sock, marshal.dumps(self.info))
        _, kind, text, data = _forkserver.serve(sock, cfg)
        # ---- a child, contained; fds 0-2 stdio, 3 status (hosted functions)
        if self._reseed_in_python:
            seed = os.urandom(12)  # a fresh program gets fresh randomness
            random.seed(int.from_bytes(seed[:8], "little"))
            if self._np_rand is not None:
                self._np_rand.seed(int.from_bytes(seed[8:], "little"))
        if kind == protocol.KIND_EXEC:
            childmod.run_program(text)
        else:
            childmod.run_function(text, data, self.max_result)

    def _mt_states(self) -> tuple[list[tuple[int, int, int, int]], bool]:
        """Where the Mersenne-Twister states of ``random`` and numpy's global generator lie,
        so the C side can refill them in each child: [(key address, words, pos address,
        value)], and whether some generator must be reseeded from Python instead (its memory
        layout is not the one checked for here)."""
        out: list[tuple[int, int, int, int]] = []
        fallback = False
        random.seed()  # no cached gauss_next
        inst = random._inst  # type: ignore[attr-defined]
        base = id(inst)
        state = inst.getstate()[1]
        if (ctypes.c_int.from_address(base + 16).value == state[-1]
                and list((ctypes.c_uint32 * 624).from_address(base + 20)) == list(state[:-1])):
            out.append((base + 20, 624, base + 16, 624))
        else:
            fallback = True
        if self._np_rand is not None:
            try:
                self._np_rand.seed(0)  # no cached gauss
                bitgen = self._np_rand._bit_generator
                addr = bitgen.ctypes.state_address
                st = bitgen.state["state"]
                ok = (list((ctypes.c_uint32 * 624).from_address(addr)) == list(st["key"])
                      and ctypes.c_int.from_address(addr + 2496).value == st["pos"])
            except Exception:  # broad: another numpy; reseed from Python
                ok = False
            if ok:
                out.append((addr, 624, addr + 2496, 624))
            else:
                fallback = True
        return out, fallback

    def _prepare_runtime(self, preload: list[str], split_seccomp: bool = False) -> None:
        """Import ``preload``, warm up, set the limits, prepare and self-test Landlock and the
        seccomp filter (``split_seccomp``: the template half for this process, the child half
        for each child), freeze the heap."""
        t0 = time.monotonic()
        for path in reversed(self.cfg.get("python_paths", [])):
            sys.path.insert(0, path)
        missing = []
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as exc:  # broad: a missing optional preload is reported
                missing.append(f"{name}: {exc!r}"[:200])
        heavy = {"numpy", "sympy"} <= set(preload)
        if not heavy or all(not m.startswith(("numpy", "sympy")) for m in missing):
            self._warm_up(warm.WARMUP if heavy else warm.LIGHT_WARMUP)
        info = self.info
        info["missing_preload"] = missing
        info["modules"] = sorted({name.split(".")[0] for name in sys.modules})
        # Keep fds 3..9 occupied so every per-call fd is >= 10 and dup2 to 0..3 never collides.
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            if fd >= 9:
                break
        # Capabilities exist only inside a user namespace we own (the jail) or as real root.
        caps = int(open("/proc/self/status").read().split("CapEff:")[1].split()[0], 16)
        self.drop_caps = caps != 0
        want_seccomp = bool(self.cfg["seccomp"])
        prog = None
        if want_seccomp and split_seccomp:
            prog = seccomp.Filter("child")
            self.template_filter = seccomp.Filter("template")
        elif want_seccomp:
            prog = seccomp.Filter()
        limits_as = warm.vm_size() + int(self.cfg["memory_mb"]) * (1 << 20)
        self.limits = childmod.Limits(limits_as, int(self.cfg["max_open_files"]))
        # Limits that hold for the zygote as well are set once here and inherited.
        fsize = int(self.cfg["max_file_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        nproc = int(self.cfg["max_processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        tempfile = sys.modules.get("tempfile")
        if tempfile is not None:
            # children find their working directory as the temp dir on their own (see child)
            setattr(tempfile, "tempdir", None)  # noqa: B010 -- module attribute, not a typo
        os.makedirs(self.workroot, mode=0o700, exist_ok=True)
        ll = self.cfg.get("landlock")
        info["landlock"] = False
        info["landlock_error"] = ""
        if ll is not None:
            try:
                rules = landlock.Ruleset(ll["read_only"], ll["read_write_files"])
                info["landlock_abi"] = rules.abi
            except OSError as exc:
                rules = None
                info["landlock_error"] = str(exc)
            if rules is not None:
                ok, err = self._self_test(rules, None)
                info["landlock"] = ok
                info["landlock_error"] = err
                self.landlock_rules = rules if ok else None
        if want_seccomp:
            ok, err = self._self_test(self.landlock_rules, prog)
            info["seccomp"] = ok
            info["seccomp_error"] = err
            self.seccomp_filter = prog if ok else None
            if not ok:
                self.template_filter = None
            info["seccomp_split"] = self.template_filter is not None
        else:
            info["seccomp"] = False
            info["seccomp_error"] = ""
        self._np_rand = getattr(sys.modules.get("numpy.random.mtrand"), "_rand", None)
        self._fork = self._pick_fork()
        # Non-dumpable: other same-uid processes (the children) cannot open /proc/<us>/mem.
        # (The controller, which forks nothing after start-up, sets it for itself too.)
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        import atexit
        atexit._clear()  # children run only the exit handlers their program registers
        gc.collect()
        gc.freeze()
        info["thp_kb"] = warm.collapse_huge_pages() if self.cfg.get("huge_pages") else 0
        info.update(pid=os.getpid(), vm_bytes=warm.vm_size(), startup_s=time.monotonic() - t0,
                    drop_caps=self.drop_caps, python=sys.version.split()[0])

    def _pick_fork(self):
        """glibc's fork() through ctypes instead of os.fork(), when that is safe.

        os.fork() runs CPython's after-fork work in the child (thread-state re-init, the
        threading/random/logging hooks). In a process with ~60 MiB of shared heap each of its
        writes is a copy-on-write fault: ~200 faults, ~1 ms per child on a small VM, half the
        cost of a trivial call. That work exists for processes whose other threads held locks
        at fork time; the zygote is single-threaded and forks only from its event loop, where
        it holds no lock, so the child may skip it. (ctypes releases the GIL around the call,
        so the child re-acquires a free GIL on return.) With any second thread we fall back.
        """
        libc_fork = _libc.fork
        libc_fork.restype = ctypes.c_int
        libc_fork.argtypes = []
        single = len(os.listdir("/proc/self/task")) == 1 and threading.active_count() == 1
        self.info["fork"] = "libc" if single else "os"
        if not single:
            return os.fork
        return libc_fork

    def _warm_up(self, code: str) -> None:
        saved = sys.stdout
        sys.stdout = io.StringIO()
        try:
            exec(compile(code, "<warmup>", "exec"), {"__name__": "__warmup__"})
        except Exception as exc:  # broad: warm-up only speeds children up; report it
            self.info["warmup_error"] = repr(exc)[:300]
        finally:
            sys.stdout = saved

    def _self_test(self, rules, prog) -> tuple[bool, str]:
        """Fork a child that applies the containment and probes it; (works?, why not)."""
        workdir = os.path.join(self.workroot, f"probe{self.index}")
        os.makedirs(workdir, exist_ok=True)
        wfd = os.open(workdir, os.O_PATH)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.close(r)
                os.chdir(workdir)
                if rules is not None:
                    rules.apply(wfd)
                    with open("probe", "w") as f:
                        f.write("x")
                    try:
                        open(os.path.join(self.workroot, "outside"), "w")
                    except PermissionError:
                        pass
                    else:
                        raise RuntimeError("landlock did not block a write outside the workdir")
                if self.drop_caps:
                    childmod.drop_capabilities()
                if prog is not None:
                    if self.template_filter is not None:  # split: the template's half first
                        self.template_filter.install()
                    prog.install()
                    def open_socket() -> None:  # the socket module is not loaded here
                        if _libc.socket(1, 1, 0) < 0:  # AF_UNIX, SOCK_STREAM
                            raise PermissionError(ctypes.get_errno(), "socket")
                    for attempt in (open_socket, os.fork,
                                    lambda: os.kill(os.getppid(), 0)):
                        try:
                            attempt()
                        except PermissionError:
                            continue
                        raise RuntimeError(f"seccomp did not block {attempt}")
                code = 0
            except BaseException as exc:  # broad: any failure means "not available"
                try:
                    os.write(w, repr(exc).encode()[:500])
                except OSError:
                    pass
                code = 2
            os._exit(code)
        os.close(w)
        os.close(wfd)
        msg = b""
        while chunk := os.read(r, 4096):
            msg += chunk
        os.close(r)
        _, status = os.waitpid(pid, 0)
        _remove_tree(workdir)
        ok = os.waitstatus_to_exitcode(status) == 0
        return ok, ("" if ok else msg.decode(errors="replace") or f"exit status {status}")

    # ---------------------------------------------------------------- serving
    def send(self, obj) -> None:
        """Queue a frame to the pool; `serve` flushes once per loop iteration (one write, and
        one wake-up of the pool, for every answer that iteration produced)."""
        data = _encoder.encode(obj)
        self.out.write(protocol.HEADER.pack(len(data)) + data)
        self._unflushed = True

    def flush(self) -> None:
        if self._unflushed:
            self._unflushed = False
            self.out.flush()

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
                        self._shutdown()
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
        started = []
        for p in prepared:
            started.append((p, *self._fork_child(p)))
        for p, pid, t0 in started:
            self._register(p, pid, t0)

    def _prepare(self, msg: list):
        req_id, kind, text, data, limit = msg[0], msg[1], msg[2], msg[3], float(msg[4])
        ch = _Child(req_id, kind, limit, msg[5] if len(msg) > 5 else "")
        fds_to_close: list[int] = []
        streams: list[Stream] = []
        try:
            if kind == protocol.KIND_EXEC:
                if data:
                    stdin_fd = os.memfd_create("stdin", 0)
                    fds_to_close.append(stdin_fd)
                    _write_all(stdin_fd, data)
                    os.lseek(stdin_fd, 0, os.SEEK_SET)
                else:  # no input: the shared /dev/null (a memfd per call costs two syscalls)
                    stdin_fd = self._devnull
                out_r, out_w = os.pipe()
                streams.append(Stream(out_r, self.max_output))
                fds_to_close.append(out_w)
                err_r, err_w = os.pipe()
                streams.append(Stream(err_r, self.max_output))
                fds_to_close.append(err_w)
                child_fds = (stdin_fd, out_w, err_w)
            else:
                stdin_fd = self._devnull
                log_r, log_w = os.pipe()
                streams.append(Stream(log_r, 8192))
                fds_to_close.append(log_w)
                child_fds = (stdin_fd, log_w, log_w)
            st_r, st_w = os.pipe()
            streams.append(Stream(st_r, self.max_result + 1))
            fds_to_close.append(st_w)
            ch.workdir = os.path.join(self.workroot, f"w{self.index}-{req_id}")
            os.mkdir(ch.workdir, 0o700)
            workdir_fd = -1
            if self.landlock_rules is not None or self.templates:
                workdir_fd = os.open(ch.workdir, os.O_PATH)
                fds_to_close.append(workdir_fd)
            if self.templates:
                payload_fd = os.memfd_create("payload", 0)
                fds_to_close.append(payload_fd)
                raw = text.encode("utf-8", "surrogatepass")
                payload = (len(raw).to_bytes(8, "little") + raw
                           + (data if kind != protocol.KIND_EXEC else b""))
                _write_all(payload_fd, payload)
                ch.payload_len = len(payload)
                extra = (payload_fd, workdir_fd)
        except OSError as exc:
            self._abandon(ch, fds_to_close, streams, f"could not prepare the call: {exc}")
            return None
        fds = (*child_fds, st_w, *extra) if self.templates else (*child_fds, st_w)
        return ch, fds, fds_to_close, streams, workdir_fd, text, data

    # ---------------------------------------------------------------- template mode
    def _send_spawn(self, p) -> None:
        ch, fds, fds_to_close, streams, _, text, _ = p
        flags = 0
        t = self.templates[0]
        if ch.kind == protocol.KIND_EXEC:
            if len(self.templates) > 1 and light_enough(text, self.light_modules):
                t = self.templates[1]
            if t.seccomp:
                flags |= _FLAG_SECCOMP
        if t.landlock:
            flags |= _FLAG_LANDLOCK
        ch.template = t
        msg = _REQUEST.pack(_OP_SPAWN, ch.kind, ch.id, ch.limit, flags, ch.payload_len)
        t.sends.append((msg, list(fds), fds_to_close))
        self._track(ch, streams, time.monotonic())

    def _track(self, ch: _Child, streams: list[Stream], start: float) -> None:
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

    def _send_kill(self, ch: _Child) -> None:
        t = ch.template
        assert t is not None  # `_kill` sends here only when templates fork the children
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
                    _remove_tree(ch.workdir)
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
        self._shutdown(remove_root=False)  # the pool goes on: its replacement worker uses it
        os._exit(3)

    def _fork_child(self, p) -> tuple[int, float]:
        ch, fds, _, _, workdir_fd, text, data = p
        # A fresh program gets fresh randomness. Reseeding here, before the fork, costs the
        # zygote ~20 us and spares each child the copy-on-write faults of doing it itself.
        seed = os.urandom(12)
        random.seed(int.from_bytes(seed[:8], "little"))
        if self._np_rand is not None:
            self._np_rand.seed(int.from_bytes(seed[8:], "little"))
        t0 = time.monotonic()
        try:
            pid = self._fork()
        except OSError:
            pid = -1
        if pid != 0:
            return pid, t0
        # ---- child: never returns
        try:
            exec_call = ch.kind == protocol.KIND_EXEC
            childmod.setup(fds, limits=self.limits, time_limit_s=ch.limit, workdir=ch.workdir,
                           workdir_fd=workdir_fd, landlock_rules=self.landlock_rules,
                           drop_caps=self.drop_caps,
                           seccomp_filter=self.seccomp_filter if exec_call else None)
            os.write(3, b"R")
            if exec_call:
                os.close(3)
                childmod.run_program(text)
            else:
                childmod.run_function(text, data, self.max_result)
        except BaseException as exc:  # broad: report any setup failure, then die
            try:
                os.write(2, f"sandbox child setup failed: {exc!r}\n".encode())
            except BaseException:  # broad: best effort
                pass
        os._exit(childmod.EXIT_SETUP_FAILED)

    def _register(self, p, pid: int, t0: float) -> None:
        ch, _, fds_to_close, streams, _, _, _ = p
        if pid < 0:
            self._abandon(ch, fds_to_close, streams, "fork failed (out of memory or pids?)")
            return
        for fd in fds_to_close:
            os.close(fd)
        ch.pid = pid
        ch.pidfd = os.pidfd_open(pid)
        self.by_fd[ch.pidfd] = (ch, None)
        self.ep.register(ch.pidfd, select.EPOLLIN)
        self._track(ch, streams, t0)

    def _abandon(self, ch: _Child, fds: list[int], streams, detail: str) -> None:
        for fd in [*fds, *(s.fd for s in streams)]:
            try:
                os.close(fd)
            except OSError:
                pass
        if ch.workdir:
            _remove_tree(ch.workdir)
        self._answer_failure(ch, detail)

    def _read_stream(self, ch: _Child, s: Stream) -> None:
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

    def _close_stream(self, ch: _Child, s: Stream) -> None:
        # fd numbers are reused by later children as soon as they are closed: track the
        # stream's own state, never "is this fd number registered"
        if s.open:
            s.open = False
            del self.by_fd[s.fd]
            self.ep.unregister(s.fd)
            os.close(s.fd)

    def _kill(self, ch: _Child) -> None:
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

    def _finalize(self, ch: _Child, status: int | None = None) -> None:
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
        _remove_tree(ch.workdir)
        streams = ch.streams
        status_data = streams[-1].data()
        code = os.waitstatus_to_exitcode(status)
        if ch.kind == protocol.KIND_EXEC:
            self._answer_exec(ch, code, streams[0], streams[1], status_data, duration)
        else:
            self._answer_call(ch, code, streams[0], status_data, duration)

    def _answer_exec(self, ch: _Child, code: int, out: Stream, err: Stream, st: bytes,
                     duration: float) -> None:
        stderr = err.data().decode("utf-8", "replace")
        status, code_out, detail = outcome.exec_outcome(
            code, setup_ok=st.startswith(b"R"), timed_out=ch.timed_out, cancelled=ch.cancelled,
            limit_s=ch.limit, note=ch.note, stderr=stderr)
        self.send([ch.id, status, out.data().decode("utf-8", "replace"), stderr, code_out,
                   duration, out.truncated or err.truncated, detail])

    def _answer_call(self, ch: _Child, code: int, log: Stream, st: bytes,
                     duration: float) -> None:
        status, payload, detail = outcome.call_outcome(
            code, st, timed_out=ch.timed_out, cancelled=ch.cancelled, limit_s=ch.limit,
            log=log.data().decode("utf-8", "replace"))
        self.send([ch.id, status, payload, detail, duration])

    def _answer_failure(self, ch: _Child, detail: str) -> None:
        if ch.kind == protocol.KIND_EXEC:
            self.send([ch.id, "sandbox_failure", "", "", None, 0.0, False, detail])
        else:
            self.send([ch.id, "sandbox_failure", None, detail, 0.0])

    def _shutdown(self, remove_root: bool = True) -> None:
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
                    _remove_tree(ch.workdir)
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
                _remove_tree(ch.workdir)
        try:  # the pool's temporary root: the last of its workers to go removes it
            os.rmdir(self.workroot)
        except OSError:
            pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _remove_tree(path: str) -> None:
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
                _remove_tree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _libc.prctl(childmod._PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with our starter
    inbuf = bytearray()
    frames: list[bytes] = []
    while not frames:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        inbuf += chunk
        frames = protocol.split_frames(inbuf)
    cfg = marshal.loads(frames[0])
    if not cfg.get("jailed"):
        # On the host, the pool dying (even SIGKILLed) should not leave working directories
        # behind: ask for SIGTERM instead, and clean up on it. (In a jail, SIGKILL: the jail's
        # tmpfs disappears with it, and SIGKILL also ends a zygote that is stopped or stuck.)
        _libc.prctl(childmod._PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        signal.signal(signal.SIGTERM, _exit_on_signal)
    z = Zygote(cfg)
    # requests sent before we were ready are served after start-up, in order
    z.inbuf = bytearray(b"".join(protocol.HEADER.pack(len(f)) + f for f in frames[1:])) + inbuf
    try:
        z.prepare()
        z.send([0, "ready", z.info])
        z.flush()
        z.serve()
    except SystemExit:
        z._shutdown()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
