"""Capability probe, run as a short program (inside the jail when one is being tested).

Prints one JSON line: which containment steps work here. ``sandbox.isolation`` uses it to decide
which levels are available, so a level is reported only after it was seen to work.
"""

from __future__ import annotations

import json
import os
import socket

from . import landlock, seccomp


def _try_in_child(fn) -> str:
    """Run ``fn`` in a forked child; return "" on success or the error text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            fn()
        except BaseException as exc:  # broad: every failure is a probe answer
            os.write(w, repr(exc).encode()[:400] or b"failed")
            code = 1
        os._exit(code)
    os.close(w)
    msg = b""
    while chunk := os.read(r, 4096):
        msg += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0 and not msg:
        return ""
    return msg.decode(errors="replace") or f"status {status}"


def _seccomp_blocks() -> None:
    seccomp.Filter().install()
    for name, attempt in (("socket", lambda: socket.socket()), ("fork", os.fork)):
        try:
            attempt()
        except PermissionError:
            continue
        raise RuntimeError(f"seccomp installed but {name} was not blocked")


def _landlock() -> None:
    if landlock.abi_version() == 0:
        raise OSError("Landlock is not available in this kernel")


def main() -> None:
    out = {"seccomp": "unsupported architecture" if not seccomp.supported() else
           _try_in_child(_seccomp_blocks),
           "landlock": _try_in_child(_landlock),
           "uid": os.getuid(), "pid": os.getpid(),
           "env_keys": sorted(os.environ)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
