"""The seccomp-BPF filter applied to every child that runs model-written code.

A deny-list filter (x86-64 only): the syscalls below fail with EPERM (clone3 with ENOSYS so
glibc falls back to clone for threads, which is allowed), everything else is allowed. Any other
ABI (i386 via int 0x80, x32) kills the process. Threads stay possible; new processes do not.

Denied, and why:
- sockets (``socket``, ``socketpair``): no network and no local IPC; without a socket fd the
  connect/send family is useless, and children inherit none.
- ``execve``/``execveat``: no new programs (no shell, no other interpreter).
- ``fork``/``vfork``, ``clone`` without CLONE_THREAD (or with namespace flags), ``clone3``:
  no new processes -- fork bombs fail at the first fork.
- ``kill``/``tgkill``/``rt_*sigqueueinfo`` aimed at any process but the caller itself, ``tkill``,
  ``pidfd_*``: no signals to the zygote or to other calls.
- ``ptrace``, ``process_vm_readv/writev``, ``kcmp``, ``process_madvise``: no reading or writing
  other processes.
- ``mount`` family, ``unshare``, ``setns``, ``chroot``, ``pivot_root``: no namespace or mount games.
- ``setsid``/``setpgid``: the child stays in the process group the zygote kills.
- uid/gid changes, kernel keyring, bpf, perf, userfaultfd, io_uring (can bypass seccomp),
  module loading, kexec, reboot, swap, clock and hostname setting, ioperm/iopl, handle-based
  opens (``open_by_handle_at`` is a classic container escape), mknod, personality, syslog, acct.

Not covered by this filter (see ``sandbox.isolation`` for what covers it): file-system access
(jail), memory and CPU (rlimits), wall time (the zygote's deadline).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_RET_KILL_PROCESS = 0x80000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LO = 16

_CLONE_THREAD = 0x00010000
_CLONE_NS_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                   | 0x20000000 | 0x40000000 | 0x00000080)  # NEWNS CGROUP UTS IPC USER PID NET TIME

# x86-64 syscall numbers
_NR = {
    "socket": 41, "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58, "execve": 59,
    "kill": 62, "ptrace": 101, "syslog": 103, "setuid": 105, "setgid": 106, "setpgid": 109,
    "setsid": 112, "setreuid": 113, "setregid": 114, "setgroups": 116, "setresuid": 117,
    "setresgid": 119, "setfsuid": 122, "setfsgid": 123, "capset": 126, "rt_sigqueueinfo": 129,
    "mknod": 133, "uselib": 134, "personality": 135, "ustat": 136, "sysfs": 139,
    "vhangup": 153, "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156, "adjtimex": 159,
    "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "create_module": 174, "init_module": 175, "delete_module": 176,
    "get_kernel_syms": 177, "query_module": 178, "quotactl": 179, "nfsservctl": 180,
    "tkill": 200, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "migrate_pages": 256, "mknodat": 259,
    "unshare": 272, "move_pages": 279, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
    "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "execveat": 322,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "pidfd_open": 434, "clone3": 435, "pidfd_getfd": 438,
    "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443, "process_mrelease": 448,
}

_DENY_EPERM = tuple(name for name in _NR if name not in (
    "clone", "kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "clone3"))
_NR["tgkill"] = 234
_SELF_ONLY_ARG0 = ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")

_PR_SET_NO_NEW_PRIVS = 38
_SYS_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER = 1


def supported() -> bool:
    """True if this interpreter can build the filter (x86-64 Linux)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


_JA = 0x05
_LEAF = 4  # at most this many syscall numbers tested linearly at a tree leaf


class _Prog:
    """A tiny assembler: instructions with symbolic forward jump targets."""

    def __init__(self) -> None:
        self.ins: list[tuple[int, object, object, object]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ins)

    def emit(self, code: int, k: object = 0, jt: object = 0, jf: object = 0) -> None:
        self.ins.append((code, jt, jf, k))

    def assemble(self) -> bytearray:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.ins):
            def off(t: object, limit: int = 256, i: int = i) -> int:
                if isinstance(t, str):
                    d = self.labels[t] - i - 1
                    if not 0 <= d < limit:
                        raise ValueError("seccomp jump out of range")
                    return d
                return int(t)  # type: ignore[call-overload]
            kk = off(k, 1 << 31) if code == _JA else int(k)  # type: ignore[call-overload]
            out += struct.pack("<HBBI", code, off(jt), off(jf), kk & 0xFFFFFFFF)
        return out


def _emit_tree(p: _Prog, nrs: list[int], actions: dict[int, str], counter: list[int]) -> None:
    """Binary search over the sorted special syscall numbers, so that the kernel's per-syscall
    evaluation (and its cache preparation at install time, which emulates the filter for every
    syscall number) walks ~log2(n) instructions instead of n. That makes installing the filter
    in each child ~6x cheaper than a linear chain."""
    if len(nrs) <= _LEAF:
        for nr in nrs:
            action = actions[nr]
            p.emit(_JEQ_K, nr, jt=0, jf=1)
            if action == "eperm":
                p.emit(_RET_K, _RET_ERRNO | errno.EPERM)
            elif action == "enosys":
                p.emit(_RET_K, _RET_ERRNO | errno.ENOSYS)
            else:
                p.emit(_JA, action)
        p.emit(_RET_K, _RET_ALLOW)
        return
    mid = len(nrs) // 2
    counter[0] += 1
    right = f"right{counter[0]}"
    p.emit(_JGE_K, nrs[mid], jt=right, jf=0)
    _emit_tree(p, nrs[:mid], actions, counter)
    p.label(right)
    _emit_tree(p, nrs[mid:], actions, counter)


PROCESS_SYSCALLS = frozenset({
    "clone", "clone3", "fork", "vfork", "kill", "tgkill", "tkill", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "setsid", "setpgid", "capset",
})
"""What a process that forks children and contains them (a template) still needs, and its
children must not have: ``part="template"`` leaves these out, ``part="child"`` has only these."""


def build_template(part: str = "all") -> tuple[bytearray, list[tuple[int, int]]]:
    """Build the filter once (in the zygote); returns the program and the slots that hold the
    child's own pid (``(instruction index, sign)``), patched by ``install`` after fork.

    ``part``: ``all`` (the whole filter, installed in each child), or the two halves of a
    split filter: ``template`` (everything but ``PROCESS_SYSCALLS``: installed once, in the
    process that forks the children, and inherited by them) and ``child`` (only
    ``PROCESS_SYSCALLS``: installed in each child on top). Stacked, the two halves give every
    syscall the action the whole filter gives it (the kernel applies the strictest), and a
    child installs a program a fifth the size (its compile and cache set-up are per child)."""
    if part not in ("all", "template", "child"):
        raise ValueError(f"part must be 'all', 'template' or 'child', got {part!r}")
    actions = {_NR[name]: "eperm" for name in _DENY_EPERM}
    actions[_NR["clone3"]] = "enosys"
    actions[_NR["clone"]] = "clone"
    actions[_NR["kill"]] = "kill_sys"
    for name in _SELF_ONLY_ARG0:
        actions[_NR[name]] = "self_only"
    process = {_NR[name] for name in PROCESS_SYSCALLS}
    if part == "template":
        actions = {nr: a for nr, a in actions.items() if nr not in process}
    elif part == "child":
        actions = {nr: a for nr, a in actions.items() if nr in process}
    used = set(actions.values())
    p = _Prog()
    slots: list[tuple[int, int]] = []
    p.emit(_LD_W_ABS, _OFF_ARCH)
    p.emit(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1, jf=0)
    p.emit(_RET_K, _RET_KILL_PROCESS)
    p.emit(_LD_W_ABS, _OFF_NR)
    p.emit(_JGE_K, _X32_SYSCALL_BIT, jt=0, jf=1)
    p.emit(_RET_K, _RET_KILL_PROCESS)
    _emit_tree(p, sorted(actions), actions, [0])
    if "clone" in used:
        # clone: a thread (CLONE_THREAD set) with no namespace flags is fine, nothing else
        p.label("clone")
        p.emit(_LD_W_ABS, _OFF_ARG0_LO)
        p.emit(_JSET_K, _CLONE_THREAD, jt=0, jf="eperm")
        p.emit(_JSET_K, _CLONE_NS_FLAGS, jt="eperm", jf="allow")
    if "kill_sys" in used:
        # kill(pid, sig): pid 0 (own group), own pid, or -own pid (own group) only
        p.label("kill_sys")
        p.emit(_LD_W_ABS, _OFF_ARG0_LO)
        p.emit(_JEQ_K, 0, jt="allow", jf=0)
        slots.append((len(p.ins), 1))
        p.emit(_JEQ_K, 0, jt="allow", jf=0)
        slots.append((len(p.ins), -1))
        p.emit(_JEQ_K, 0, jt="allow", jf="eperm")
    if "self_only" in used:
        # tgkill / rt_sigqueueinfo / rt_tgsigqueueinfo: first argument must be our own tgid
        p.label("self_only")
        p.emit(_LD_W_ABS, _OFF_ARG0_LO)
        slots.append((len(p.ins), 1))
        p.emit(_JEQ_K, 0, jt="allow", jf="eperm")
    p.label("allow")
    p.emit(_RET_K, _RET_ALLOW)
    p.label("eperm")
    p.emit(_RET_K, _RET_ERRNO | errno.EPERM)
    return p.assemble(), slots


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)


class Filter:
    """The filter, assembled once in the zygote; ``install`` patches in the child's pid and
    loads it. Preallocated so a child does no allocation here (fewer copy-on-write faults)."""

    def __init__(self, part: str = "all") -> None:
        prog, self.slots = build_template(part)
        self.prog = prog
        self._buf = (ctypes.c_char * len(prog)).from_buffer(prog)
        self._fprog = _SockFprog(len(prog) // 8, ctypes.addressof(self._buf))
        self._ref = ctypes.byref(self._fprog)

    def install(self, pid: int | None = None) -> None:
        """Install on the calling (single-threaded) process; irreversible.

        Sets no_new_privs first, as the kernel requires for an unprivileged filter.
        """
        pid = os.getpid() if pid is None else pid
        for index, sign in self.slots:
            struct.pack_into("<I", self.prog, index * 8 + 4, (sign * pid) & 0xFFFFFFFF)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl(NO_NEW_PRIVS): {os.strerror(e)}")
        if _libc.syscall(_SYS_SECCOMP, _SECCOMP_SET_MODE_FILTER, 0, self._ref) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"seccomp(SET_MODE_FILTER): {os.strerror(e)}")
