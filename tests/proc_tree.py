"""The host's process tree, read from /proc (for tests that check what outlives what)."""

from __future__ import annotations

import os


def children() -> dict[int, list[int]]:
    """parent pid -> its children's pids, for every process visible now."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (children, their children, ...)."""
    kids, out, todo = children(), [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22), None if it is gone:
    with `pid`, what names one process (pids wrap at pid_max and are handed out again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int, start: int | None = None) -> bool:
    """A process that exists and is not a zombie; given `start` (`started(pid)` when it was
    seen), the same process, not a later one that got its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and (start is None or int(fields[19]) == start)
