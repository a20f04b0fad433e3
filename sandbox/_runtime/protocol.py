"""Framing between the pool and a zygote: 4-byte little-endian length, then a msgpack array.

Pool -> zygote
  config (first frame):  {"...": ...}    a dict, marshal-encoded (read before msgspec is
                                          imported); its keys are read by controller.Controller
                                          and template.Runtime
  exec:    [id, 0, code: str, stdin: bytes, time_limit_s: float, note: str (optional)]
  call:    [id, 1, target: str, payload: bytes (pickled (args, kwargs)), time_limit_s: float]
  cancel:  [id, 2]

Zygote -> pool
  ready:   [0, "ready", info: dict]
  exec:    [id, status, stdout: str, stderr: str, exit_code: int | None, duration_s, truncated,
            detail]
  call:    [id, status, payload: bytes | None (pickled value), detail, duration_s]
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<I")
KIND_EXEC = 0
KIND_CALL = 1
KIND_CANCEL = 2
MAX_FRAME = 256 << 20


def split_frames(buf: bytearray) -> list[bytes]:
    """Remove and return every complete frame payload at the front of ``buf``."""
    out = []
    pos = 0
    n = len(buf)
    while n - pos >= 4:
        (size,) = HEADER.unpack_from(buf, pos)
        if size > MAX_FRAME:
            raise ValueError(f"frame of {size} bytes exceeds the limit")
        if n - pos - 4 < size:
            break
        out.append(bytes(buf[pos + 4:pos + 4 + size]))
        pos += 4 + size
    if pos:
        del buf[:pos]
    return out
