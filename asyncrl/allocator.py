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

`configure()` (called by the `asyncrl` command at start) keeps large blocks out of the heaps
altogether: glibc's mmap threshold is fixed at `MMAP_THRESHOLD` (4 MiB) instead of rising to
32 MiB, so a KV-cache buffer, a gradient or a logits tensor is mapped on its own and unmapped
when freed, and resident memory follows what is live within a phase, not only after one. The
local engine's growing cache (a fresh, larger buffer per layer every few dozen steps) left holes
no later buffer fitted: an evaluation of SmolLM2 on 16 problems x 9 answers peaked at 2.77 GiB
with the default and 2.32 GiB with the threshold fixed, and ran no slower (136 s and 119 s).
A process that sets `MALLOC_MMAP_THRESHOLD_` itself keeps its setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

MMAP_THRESHOLD = 4 << 20
"""Bytes from which `configure` has glibc map a block on its own (released when freed)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


@functools.cache
def _libc_fn(name: str, argtypes: tuple[Any, ...]) -> Any:
    """glibc's function `name`, or None where the C library has none (macOS, musl)."""
    lib = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(lib) if lib else ctypes.CDLL(None)
        fn = getattr(libc, name)
    except (OSError, AttributeError):  # not glibc (or no libc to load)
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def _trim() -> Any:
    return _libc_fn("malloc_trim", (ctypes.c_size_t,))


def configure(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `mmap_threshold` bytes (see the module docstring); True
    when set, False without glibc's `mallopt` or when the environment sets
    `MALLOC_MMAP_THRESHOLD_` (that setting stands)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    fn = _libc_fn("mallopt", (ctypes.c_int, ctypes.c_int))
    return bool(fn(_M_MMAP_THRESHOLD, mmap_threshold)) if fn is not None else False


def release() -> bool:
    """Give the heap's free pages back to the OS; True when glibc released some memory, False
    when it had none to release or the C library has no `malloc_trim`."""
    fn = _trim()
    return bool(fn(0)) if fn is not None else False
