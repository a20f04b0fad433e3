"""The process children are forked from: prepared once, then it only forks.

Owns that process's preparation (``Runtime.prepare``: import the preloads, warm them up, set
the limits every child inherits, prepare and self-test Landlock and the seccomp filter, freeze
the heap) and its two ways of forking:

- a **template** (``start_template``, the default when the C module ``_forkserver`` is built):
  the controller forks it; it prepares, reports its info, and enters ``_forkserver.serve``, a
  loop in C that forks on request, contains the child in C and returns into Python only in
  the child, with the call (``Runtime.serve_as_template``). It writes nothing between forks.
- the **Python shape** (``Runtime.fork_child``): the zygote itself is prepared and forks each
  child with glibc ``fork``; the child contains itself (``child.setup``).

Does not own the per-call bookkeeping (pipes, deadlines, answers: ``controller`` and
``children``), nor what a child does once forked (``child``).

Rule: the process children fork from never maps msgspec, epoll or sockets. Every shared
library is ~5 memory regions, and every region costs every fork and every exit (~1.8 us each
on this machine), so neither this module nor anything it imports (``child``, ``children``,
``landlock``, ``outcome``, ``protocol``, ``seccomp``, ``warm``) imports ``msgspec``,
``select`` or ``socket``, at module level or in any function; the controller imports them
only after its templates were forked. ``tests/sandbox/test_template_imports.py`` checks the
text, and ``tests/sandbox/test_spawner.py`` a running template's memory map.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import marshal
import os
import random
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from . import child as childmod
from . import landlock, protocol, seccomp, warm
from .children import Prepared, remove_tree

try:  # the template's fork loop in C; without it the zygote forks from Python (slower)
    from . import _forkserver  # type: ignore[attr-defined]  # built by pip, maybe absent
    FORKSERVER_ERROR = ""
except ImportError as _exc:
    _forkserver = None
    FORKSERVER_ERROR = repr(_exc)[:300]

HAVE_FORKSERVER = _forkserver is not None
_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """Non-dumpable: other same-uid processes (the children) cannot open /proc/<us>/mem."""
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def start_template(cfg: dict, name: str, preload: list[str],
                   inherited: list[int]) -> tuple[int, int, dict]:
    """Fork a template (``name``: "main" or "light"): it imports ``preload`` and then only
    forks, in C; the calling process (the controller) keeps every piece of per-call
    bookkeeping, so nothing it does writes to pages that the children share with the process
    they are forked from. ``inherited``: the fds of templates started before, which the new
    one closes. Returns (the controller's end of its socket, its pid, the info it reported)."""
    assert _forkserver is not None
    ours, theirs = _forkserver.seqpacket_pair()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ours)
            for fd in inherited:
                os.close(fd)
            Runtime(cfg).serve_as_template(theirs, preload, light=name == "light")
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
    return ours, pid, marshal.loads(data)


class Runtime:
    """What the process children fork from prepared, and every child inherits: the limits,
    the Landlock ruleset, the seccomp filter(s), the fork function, and ``info`` (what it
    found, reported to the pool)."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.index = int(cfg["index"])
        self.max_result = int(cfg["function_max_result_bytes"])
        self.workroot: str = cfg.get("workroot") or "/tmp"
        self.info: dict = {}
        self.landlock_rules: landlock.Ruleset | None = None
        self.drop_caps = False
        self.seccomp_filter: seccomp.Filter | None = None  # what each exec child installs
        self.template_filter: seccomp.Filter | None = None  # split filter: the template's half
        self.limits = childmod.Limits(0, 0)  # set by prepare()
        self.np_rand: Any = None  # numpy's global generator, when numpy is loaded
        self.fork: Callable[[], int] = os.fork  # by prepare()
        self.reseed_in_python = True

    # ---------------------------------------------------------------- template shape
    def serve_as_template(self, sock: int, preload: list[str], light: bool) -> None:
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
        self.prepare(preload, split_seccomp=light)
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
        cfg["reseed"], self.reseed_in_python = self._mt_states()
        self.info["reseed"] = "c" if not self.reseed_in_python else "python"
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
        if self.reseed_in_python:
            self.reseed()  # a fresh program gets fresh randomness
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
        if self.np_rand is not None:
            try:
                self.np_rand.seed(0)  # no cached gauss
                bitgen = self.np_rand._bit_generator
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

    def reseed(self) -> None:
        """Fresh seeds for ``random`` and numpy's global generator."""
        seed = os.urandom(12)
        random.seed(int.from_bytes(seed[:8], "little"))
        if self.np_rand is not None:
            self.np_rand.seed(int.from_bytes(seed[8:], "little"))

    # ---------------------------------------------------------------- Python shape
    def fork_child(self, p: Prepared) -> tuple[int, float]:
        """Fork ``p``'s child from this process: it contains itself and runs the call (never
        returns in the child). Returns (pid, or -1 when fork failed; when it forked)."""
        ch = p.child
        # A fresh program gets fresh randomness. Reseeding here, before the fork, costs the
        # zygote ~20 us and spares each child the copy-on-write faults of doing it itself.
        self.reseed()
        t0 = time.monotonic()
        try:
            pid = self.fork()
        except OSError:
            pid = -1
        if pid != 0:
            return pid, t0
        # ---- child: never returns
        try:
            exec_call = ch.kind == protocol.KIND_EXEC
            fds = cast("tuple[int, int, int, int]", p.fds)  # stdio and status, nothing more here
            childmod.setup(fds, limits=self.limits,
                           time_limit_s=ch.limit, workdir=ch.workdir, workdir_fd=p.workdir_fd,
                           landlock_rules=self.landlock_rules, drop_caps=self.drop_caps,
                           seccomp_filter=self.seccomp_filter if exec_call else None)
            os.write(3, b"R")
            if exec_call:
                os.close(3)
                childmod.run_program(p.text)
            else:
                childmod.run_function(p.text, p.data, self.max_result)
        except BaseException as exc:  # broad: report any setup failure, then die
            try:
                os.write(2, f"sandbox child setup failed: {exc!r}\n".encode())
            except BaseException:  # broad: best effort
                pass
        os._exit(childmod.EXIT_SETUP_FAILED)

    # ---------------------------------------------------------------- preparation
    # Over 80 lines on purpose: the template's preparation is one ordered sequence (imports,
    # warm-up, limits, Landlock, seccomp, heap freeze) whose order is the security argument;
    # split into helpers, a reader could no longer check the order in one place.
    def prepare(self, preload: list[str], split_seccomp: bool = False) -> None:
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
        self.np_rand = getattr(sys.modules.get("numpy.random.mtrand"), "_rand", None)
        self.fork = self._pick_fork()
        # (The controller, which forks nothing after start-up, makes itself non-dumpable too.)
        make_undumpable()
        import atexit
        atexit._clear()  # children run only the exit handlers their program registers
        gc.collect()
        gc.freeze()
        info["thp_kb"] = warm.collapse_huge_pages() if self.cfg.get("huge_pages") else 0
        info.update(pid=os.getpid(), vm_bytes=warm.vm_size(), startup_s=time.monotonic() - t0,
                    drop_caps=self.drop_caps, python=sys.version.split()[0])

    def _pick_fork(self) -> Callable[[], int]:
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
        remove_tree(workdir)
        ok = os.waitstatus_to_exitcode(status) == 0
        return ok, ("" if ok else msg.decode(errors="replace") or f"exit status {status}")
