"""`asyncrl.allocator.release`: freed heap pages go back to the OS (glibc)."""

from __future__ import annotations

import ctypes

import pytest

from asyncrl import allocator

BLOCK = 64 * 1024  # under glibc's smallest mmap threshold (128 KiB): always heap memory
BLOCKS = 1600  # 100 MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(allocator._trim() is None, reason="the C library has no malloc_trim")
def test_freed_heap_memory_below_a_live_block_leaves_the_process_on_release() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)  # resident
    guard = libc.malloc(BLOCK)  # live above them: the heap cannot shrink from its top
    try:
        for b in blocks:
            libc.free(b)
        held = _rss()
        assert allocator.release() is True
        # freed but resident until trimmed: most of the 100 MiB leaves now
        assert held - _rss() > BLOCKS * BLOCK // 2
    finally:
        libc.free(guard)


def test_release_is_safe_to_call_with_nothing_to_give_back() -> None:
    allocator.release()
    assert allocator.release() in (True, False)
