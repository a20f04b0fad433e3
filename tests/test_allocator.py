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


CHILD = r"""
import ctypes, sys
sys.path.insert(0, {root!r})
from asyncrl import allocator
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
configured = allocator.configure() if {configure} else None
big = 8 << 20
first = libc.malloc(big); ctypes.memset(first, 1, big); libc.free(first)  # raises glibc's
# dynamic threshold to 8 MiB when it is not fixed: what follows would then be heap memory
blocks = [libc.malloc(big) for _ in range(12)]
for b in blocks:
    ctypes.memset(b, 1, big)
guard = libc.malloc(big)  # live above them: the heap cannot shrink from its top
ctypes.memset(guard, 1, big)
before = rss()
for b in blocks:
    libc.free(b)
print(configured, (before - rss()) >> 20)
"""


@pytest.mark.skipif(allocator._libc_fn("mallopt", (ctypes.c_int, ctypes.c_int)) is None,
                    reason="the C library has no mallopt")
@pytest.mark.parametrize("configure", [True, False])
def test_configure_returns_large_freed_blocks_at_once(configure: bool, monkeypatch) -> None:
    """With the threshold fixed, 96 MiB of freed 8 MiB blocks leave the process when freed,
    below a live block and without a trim; glibc's default keeps them (the threshold rose to
    their size at the first free)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=root, configure=configure)],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    freed_mib = int(out[1])
    if configure:
        assert out[0] == "True" and freed_mib >= 90
    else:
        assert freed_mib < 16


def test_configure_leaves_a_threshold_set_in_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert allocator.configure() is False
