"""What a forked child does: contain itself, then run one call.

Runs in the child right after ``os.fork()`` in the zygote, single-threaded, with every module
already imported (nothing here may import lazily: under seccomp and rlimits an import can
fail). The order matters: stdio fds first, then session and working directory, Landlock (it
needs the zygote's pre-opened path fds), closing every other fd (so nothing of the zygote
leaks), capabilities, rlimits, and the seccomp filter last, because the steps before it need
syscalls the filter denies.

File descriptors on entry to user code: 0 stdin, 1 stdout, 2 stderr; nothing else. fd 3 (the
status pipe) carries one ``R`` byte meaning "setup done" and is closed before user code runs,
so a program cannot forge a sandbox failure; hosted functions write their pickled result there.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import ctypes
import gc
import importlib
import itertools
import os
import resource
import signal
import sys
import threading
import traceback
import types

CHILD_NICE = 10
EXIT_SETUP_FAILED = 250
EXIT_MEMORY = 249

_PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable capability sets (no-op when empty)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.syscall(126, ctypes.byref(header), ctypes.byref(data)), "capset")


class Limits:
    """Per-pool limits a child sets itself (FSIZE, NPROC, CORE are set once in the zygote)."""

    __slots__ = ("as_bytes", "nofile")

    def __init__(self, as_bytes: int, nofile: int) -> None:
        self.as_bytes = as_bytes
        self.nofile = nofile


def setup(fds: tuple[int, int, int, int], *, limits: Limits, time_limit_s: float,
          workdir: str, workdir_fd: int, landlock_rules, drop_caps: bool,
          seccomp_filter) -> None:
    """Contain the current (freshly forked) process. Raises on any failure."""
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's clean-up handler is not ours
    # Below the zygote and the pool: a call burning CPU in many threads must not delay the
    # deadline that kills it, nor the bookkeeping of other calls.
    os.nice(CHILD_NICE)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The working directory is also the temp dir: TMPDIR is unset and (under Landlock) /tmp is
    # not writable, so tempfile falls back to the cwd -- no per-call environment writes.
    os.chdir(workdir)
    if landlock_rules is not None:
        landlock_rules.apply(workdir_fd)  # needs the zygote's O_PATH fds: before closerange
    os.closerange(4, 0x7FFFFFFF)
    if drop_caps:
        drop_capabilities()
    cpu = int(time_limit_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.as_bytes, limits.as_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile))
    if seccomp_filter is not None:
        seccomp_filter.install()


def _print_exception(exc: BaseException, skip_frames: int | None) -> None:
    """Print like the interpreter would, without the sandbox's own ``skip_frames`` outermost
    frames (``None``: no frames at all, as for a program that does not compile)."""
    tb = exc.__traceback__
    if skip_frames is None:
        tb = None
    else:
        for _ in range(skip_frames):
            if tb is None:
                break
            tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _finish(code: int) -> None:
    """Exit like an interpreter would (join threads, atexit, flush), without its teardown.

    The common case (no thread started, no exit handler) skips the machinery: each Python
    object it touches is a copy-on-write fault in a forked child."""
    if len(threading._active) > 1 or threading._limbo:  # type: ignore[attr-defined]
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # waits for non-daemon threads
        except BaseException:  # broad: user threads may leave any state; exit anyway
            pass
    if atexit._ncallbacks():
        try:
            atexit._run_exitfuncs()
        except BaseException:  # broad: atexit already printed what failed
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException as exc:  # broad: a broken stream must not block exit
            try:
                os.write(2, f"\nsandbox: could not flush output: {exc!r}\n".encode())
            except OSError:
                pass
            code = code or 120
    os._exit(code)


def _exit_code_of(exc: SystemExit) -> int:
    c = exc.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    try:
        print(c, file=sys.stderr)
    except BaseException:  # broad: printing the message is best effort
        pass
    return 1


_prepared_main: types.ModuleType | None = None
_gc_was_on = False  # the template turns automatic GC off while a child sets up, if it was on


def pause_gc() -> None:
    """Turn automatic garbage collection off until the program starts (``_start_gc``): the
    child's own parsing and compiling would otherwise trigger collections (every object they
    visit is a copy-on-write fault). The program runs with the collector as it was."""
    global _gc_was_on
    _gc_was_on = gc.isenabled()
    gc.disable()


def _start_gc() -> None:
    if _gc_was_on:
        gc.enable()


def prepare_main() -> None:
    """Set up what a program sees as its interpreter (``sys.argv``, ``sys.path[0]``, a fresh
    ``__main__``) ahead of the fork, in the process children are forked from."""
    global _prepared_main
    sys.argv = ["-c"]
    if sys.path and sys.path[0] != "":
        sys.path.insert(0, "")
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.displayhook = _display
    _prepared_main = main


# opcode.opmap's values on 3.11 (the ``opcode`` module would map its C helper into the
# templates); other versions take the AST path.
_POP_TOP, _LOAD_CONST, _RETURN_VALUE = 1, 100, 83
_PRINT_EXPR = 70 if sys.version_info[:2] == (3, 11) else None


def _display(value: object) -> None:
    if value is not None:
        print(repr(value))


def _only_comments(lines: list[str], line: int, col: int) -> bool:
    """Whether nothing but blanks and comments follows (1-based `line`, byte column `col`):
    the dropped result is then the program's last statement. The compiler emits no code for a
    last statement that is a constant (`7`, `'text'`, `...`) or `pass`, so the POP_TOP at the
    end can be an earlier statement's; whatever follows it sends the program the AST way."""
    rest = [lines[line - 1].encode()[col:].decode(errors="replace"), *lines[line:]]
    return all(not r.strip() or r.lstrip().startswith("#") for r in rest)


def split_trailing_expression(code: str) -> tuple[types.CodeType, types.CodeType | None]:
    """(module code, code of its trailing expression or None): the program's last top-level
    statement, if it is an expression, has its value's repr printed (``None`` excepted).

    Fast path, no AST objects (building them is most of a small call's parse cost): compile
    the program, and if it ends with an expression statement's result being dropped
    (``POP_TOP``) at a top-level position whose source is an expression, make that instruction
    ``PRINT_EXPR`` (it calls ``sys.displayhook``, which the template set to print the repr).
    Anything else -- a statement that is not an expression, an expression that does not
    start a line, a layout this check does not know -- takes the AST path.
    """
    body = compile(code, "<string>", "exec", dont_inherit=True)
    b = body.co_code
    n = len(b)
    if (_PRINT_EXPR is not None and n >= 6 and b[n - 6] == _POP_TOP
            and b[n - 4] == _LOAD_CONST and b[n - 2] == _RETURN_VALUE
            and body.co_consts[b[n - 3]] is None and "\r" not in code
            and sys.displayhook is _display and "displayhook" not in code):
        # (PRINT_EXPR calls whatever sys.displayhook is when it runs: a program that sets
        # its own would see its hook called where the AST rule prints the repr)
        l0, l1, c0, c1 = next(itertools.islice(body.co_positions(), n // 2 - 3, None))
        lines = code.split("\n")
        if (c0 == 0 and l0 is not None and l1 is not None and c1 is not None
                and not (l0 >= 2 and lines[l0 - 2].endswith("\\"))
                and _only_comments(lines, l1, c1)):
            seg = [line.encode() for line in lines[l0 - 1:l1]]
            seg[-1] = seg[-1][:c1]
            try:
                compile(b"\n".join(seg), "<string>", "eval", dont_inherit=True)
            except SyntaxError:
                pass  # e.g. a `with` statement's exit: the AST path decides
            else:
                patched = b[:n - 6] + bytes((_PRINT_EXPR, 0)) + b[n - 4:]
                return body.replace(co_code=patched), None
    tree = ast.parse(code, "<string>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
    body = compile(tree, "<string>", "exec")
    return body, (compile(last, "<string>", "eval") if last is not None else None)


def run_program(code: str) -> None:
    """Run ``code`` as ``__main__`` (fresh globals); print the repr of a trailing expression.

    Never returns: exits with the program's status (EXIT_MEMORY on an uncaught MemoryError).
    """
    # sys.stdin/stdout/stderr are the zygote's own objects, now on the call's fds 0/1/2 (the
    # zygote never reads or buffers through them); reusing them spares ~100 page faults
    if _prepared_main is None:
        prepare_main()
    main = _prepared_main
    assert main is not None
    try:
        body, tail = split_trailing_expression(code)
    except MemoryError as exc:
        _print_exception(exc, None)
        _finish(EXIT_MEMORY)
    except BaseException as exc:  # broad: SyntaxError, ValueError (NUL), RecursionError
        # No frames: like `python -c`, a program that does not compile shows only the error
        # (the parser's own frames are the sandbox's, not the program's).
        _print_exception(exc, None)
        _finish(1)
    _start_gc()
    try:
        exec(body, main.__dict__)
        if tail is not None:
            value = eval(tail, main.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        _finish(_exit_code_of(exc))
    except MemoryError as exc:
        _print_exception(exc, 1)
        _finish(EXIT_MEMORY)
    except BaseException as exc:  # broad: any exception of the program is its error
        _print_exception(exc, 1)
        _finish(1)
    _finish(0)


FUNCTION_MODULES = ("pickle",)
"""What ``run_function`` needs loaded before the fork."""


def _resolve(target: str):
    module, _, qual = target.partition(":")
    if not module or not qual:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def run_function(target: str, payload: bytes, max_result_bytes: int) -> None:
    """Call ``target(*args, **kwargs)`` and write ``pickle((ok, value_or_traceback))`` to fd 3.

    ``pickle`` was imported by the process this child was forked from (``FUNCTION_MODULES``);
    the light template, which runs no functions, does not map it."""
    import pickle

    _start_gc()
    try:
        args, kwargs = pickle.loads(payload)
        value = _resolve(target)(*args, **(kwargs or {}))
        try:
            data = pickle.dumps((True, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # broad: any pickling failure is reported the same way
            data = pickle.dumps((False, f"result is not picklable: {exc!r}"))
    except BaseException:  # broad: the function's failure is the result
        data = pickle.dumps((False, traceback.format_exc(limit=20)))
    if len(data) > max_result_bytes:
        data = pickle.dumps((False, f"result of {len(data)} bytes exceeds the limit "
                                    f"of {max_result_bytes}"))
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(3, view):]
    except OSError:
        os._exit(EXIT_SETUP_FAILED)
    os._exit(0)
