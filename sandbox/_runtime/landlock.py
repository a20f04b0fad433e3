"""Landlock: confine a child's file-system access to its own working directory.

Every call gets a private working directory; Landlock makes "private" true. The child may
read (and execute) only the paths the pool lists -- the Python install, the system libraries,
a few device nodes -- and may write only inside its own working directory. Other calls'
directories, the rest of /tmp, the project and the host's files are out of reach, even for a
child running as the same user (or as root without capabilities). With ABI >= 4 the domain
also handles TCP bind/connect (nothing granted), with ABI >= 6 it scopes signals and abstract
Unix sockets to the domain (a child cannot signal the zygote or another call).

Prepared once in the zygote (``Ruleset``: read-only paths opened O_PATH, rule structs packed)
so a child only issues the syscalls: create, add rules, restrict (~50 us in the kernel).
"""

from __future__ import annotations

import ctypes
import os
import struct

_SYS_CREATE = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT = 446
_CREATE_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
TRUNCATE = 1 << 14
IOCTL_DEV = 1 << 15
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    v = _syscall(_SYS_CREATE, None, 0, _CREATE_VERSION)
    return v if v > 0 else 0


def _handled_fs(abi: int) -> int:
    bits = 13  # ABI 1: execute .. make_sym
    if abi >= 2:
        bits = 14  # refer
    if abi >= 3:
        bits = 15  # truncate
    if abi >= 5:
        bits = 16  # ioctl_dev
    return (1 << bits) - 1


class Ruleset:
    """Read-only paths and read-write files, prepared in the zygote, applied in each child."""

    def __init__(self, read_only: list[str], read_write_files: list[str]) -> None:
        abi = abi_version()
        if abi == 0:
            raise OSError("Landlock is not available in this kernel")
        self.abi = abi
        self.handled = _handled_fs(abi)
        if abi >= 6:
            attr = struct.pack("<QQQ", self.handled, 0b11, 0b11)  # net: bind+connect; scopes
        elif abi >= 4:
            attr = struct.pack("<QQ", self.handled, 0b11)
        else:
            attr = struct.pack("<Q", self.handled)
        self._attr = ctypes.create_string_buffer(attr, len(attr))
        self._attr_size = len(attr)
        self._fds: list[int] = []
        self._rules: list[ctypes.Array] = []
        ro_dir = (EXECUTE | READ_FILE | READ_DIR) & self.handled
        ro_file = (EXECUTE | READ_FILE) & self.handled
        rw_file = (READ_FILE | WRITE_FILE | TRUNCATE | IOCTL_DEV) & self.handled
        for path, rights in ([(p, None) for p in read_only]
                             + [(p, rw_file) for p in read_write_files]):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a path this host does not have needs no rule
            if rights is None:
                rights = ro_dir if os.path.isdir(path) else ro_file
            self._fds.append(fd)
            self._rules.append(self._pack(rights, fd))
        self._all_dir = self.handled
        self._workdir_rule = ctypes.create_string_buffer(12)
        # the same ruleset as plain data, for the template's C fork loop
        self.attr = bytes(attr)
        self.rules = [struct.unpack("<Qi", bytes(r))[:2] for r in self._rules]
        self.workdir_access = self.handled

    @staticmethod
    def _pack(rights: int, fd: int) -> ctypes.Array:
        return ctypes.create_string_buffer(struct.pack("<Qi", rights, fd), 12)

    def apply(self, workdir_fd: int) -> None:
        """Restrict the calling process; ``workdir_fd`` (O_PATH) gets every right."""
        rs = _syscall(_SYS_CREATE, self._attr, self._attr_size, 0)
        if rs < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
        try:
            for rule in self._rules:
                if _syscall(_SYS_ADD_RULE, rs, _RULE_PATH_BENEATH, rule, 0) != 0:
                    raise OSError(ctypes.get_errno(), "landlock_add_rule")
            struct.pack_into("<Qi", self._workdir_rule, 0, self._all_dir, workdir_fd)
            if _syscall(_SYS_ADD_RULE, rs, _RULE_PATH_BENEATH, self._workdir_rule, 0) != 0:
                raise OSError(ctypes.get_errno(), "landlock_add_rule(workdir)")
            if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
            if _syscall(_SYS_RESTRICT, rs, 0) != 0:
                raise OSError(ctypes.get_errno(), "landlock_restrict_self")
        finally:
            os.close(rs)
