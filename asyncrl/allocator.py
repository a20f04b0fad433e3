"""Handing the C heap's freed pages back to the operating system after a phase that freed a lot.

Owns: `release()`, a call of glibc's `malloc_trim(0)` (nothing elsewhere: macOS, musl, or a
libc without it). Does not own: when to call it (the trainer after its steps, checkpoints and
exports; the local engine when its batch empties and after a weight update).

Why: torch's CPU tensors come from the C allocator. A block under glibc's mmap threshold (which
rises to 32 MiB as large blocks are freed, so nearly every activation, gradient and KV-cache
tensor of a small model falls under it) lives in one of malloc's heaps, one arena per thread
that allocates; when the tensor is freed its pages stay resident in that arena until malloc
reuses them. A run allocates in several threads (the SFT and RL steps, checkpoints and weight
syncs in asyncio's worker threads, the engine's forwards in its own), so each arena kept the
high-water mark of the work it last did, and the process's resident memory grew toward the sum
of those marks rather than their maximum (`bench/stage_memory.py` measures it, by phase).
`malloc_trim(0)` returns every whole free page of every arena (`madvise(MADV_DONTNEED)`), so
after a phase the process holds what is live, not what the phase once held.

Cost: one pass over the free lists, milliseconds for a heap of a few GiB; the pages given back
are faulted in again (zero-filled) when a later phase allocates them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _trim() -> Any:
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (or no libc to load): nothing to trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release() -> bool:
    """Give the heap's free pages back to the OS; True when glibc released some memory, False
    when it had none to release or the C library has no `malloc_trim`."""
    fn = _trim()
    return bool(fn(0)) if fn is not None else False
