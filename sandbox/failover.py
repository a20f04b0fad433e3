"""Failover policy of ``HttpSandboxClient``: which node a batch goes to, how long one attempt
may take, and when a node is down. Pure state and arithmetic: no I/O, no event loop, no tasks
(the client does the HTTP, the probing and the logging).

A node is in one of three states:

- **up**: picked by fewest calls outstanding;
- **busy** (``busy_until`` in the future): it answered 503 (overloaded or draining: nothing
  ran); skipped while another node is up, tried again once the short back-off passes;
- **down** (``down``): it failed in a way that says it cannot serve: a connection refused,
  reset or timed out, or an attempt that went silent (no result and no heartbeat for the
  client's ``stall_timeout_s``). A down node is never picked; the client probes its
  ``/health`` in the background (delays from ``probe_delays``) and puts it back up when it
  answers 200.

How long an attempt may take (``attempt_budget``): a node that heartbeats
(``sandbox.wire``) is known alive for as long as bytes arrive, so its silence is caught after
``stall_timeout_s`` whatever the calls' time limits; the attempt's whole budget only matters
for a live node that is too slow (queued behind other work). A batch cannot legitimately run
longer than its longest call's time limit plus a margin (``work_bound``): when another node
could still take the calls, an attempt is given that much, or everything but that much of the
time left, whichever is larger, so that a failover keeps enough time to run the calls too. A
node that sends no heartbeats (an older ``sandbox serve``) is waited on for at most the work
bound, since nothing else tells a long call from a dead link there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .config import PoolConfig

_DEFAULTS = PoolConfig()


class Node:
    """One sandbox node (or one front end of a node) as the client sees it."""

    __slots__ = ("busy_until", "down", "down_reason", "down_since", "isolation",
                 "max_time_limit_s", "outstanding", "sent", "time_limit_s", "url")

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.outstanding = 0
        self.sent = 0
        self.isolation = ""
        # the node's default and largest call time limits (from its /health; the pool's
        # defaults until it says otherwise)
        self.time_limit_s = _DEFAULTS.time_limit_s
        self.max_time_limit_s = _DEFAULTS.max_time_limit_s
        self.busy_until = 0.0
        self.down = False
        self.down_reason = ""
        self.down_since = 0.0

    def __repr__(self) -> str:
        return f"Node({self.url!r}, {'down: ' + self.down_reason if self.down else 'up'})"

    def mark_down(self, reason: str, now: float) -> bool:
        """Take the node out of rotation; True if it was up (the caller then starts a probe)."""
        if self.down:
            return False
        self.down, self.down_reason, self.down_since = True, reason, now
        return True

    def mark_up(self, now: float) -> float:
        """Put the node back in rotation; returns how many seconds it was down."""
        was = now - self.down_since if self.down else 0.0
        self.down, self.down_reason = False, ""
        self.busy_until = 0.0
        return was

    def call_limit_s(self, requested: float | None) -> float:
        """The time limit this node gives a call that asked for ``requested`` seconds."""
        limit = self.time_limit_s if requested is None else requested
        return min(limit, self.max_time_limit_s)


def pick(nodes: Sequence[Node], tried: Iterable[Node], now: float) -> Node | None:
    """The node for the next attempt, or None when every node is down.

    Prefers nodes this batch has not tried; among those, the ones not busy, by fewest calls
    outstanding; if all are busy, the one whose back-off ends first."""
    live = [n for n in nodes if not n.down]
    if not live:
        return None
    seen = set(tried)
    fresh = [n for n in live if n not in seen] or live
    ready = [n for n in fresh if n.busy_until <= now]
    if ready:
        return min(ready, key=lambda n: n.outstanding)
    return min(fresh, key=lambda n: n.busy_until)


def work_bound(node: Node, limits: Iterable[float | None], margin_s: float) -> float:
    """Seconds within which ``node`` must have answered calls with these requested limits:
    the longest limit it applies, plus ``margin_s`` (process start, transport, queueing)."""
    return max((node.call_limit_s(x) for x in limits), default=0.0) + margin_s


def attempt_budget(remaining_s: float, bound_s: float, can_fail_over: bool) -> float:
    """Seconds one attempt may take out of the ``remaining_s`` before the calls' deadline.

    Without a node to fail over to (or no attempt left), all of it. Otherwise at least one
    work bound (so that a live node can finish the calls) and at most everything but one work
    bound (kept for the failover to run them)."""
    if not can_fail_over or remaining_s <= 0:
        return max(remaining_s, 0.0)
    return max(min(bound_s, remaining_s), remaining_s - bound_s)


def probe_delays(first_s: float, cap_s: float) -> Iterator[float]:
    """Waits between health probes of a down node: ``first_s``, doubling, capped at ``cap_s``."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, cap_s)
