"""Counters and a latency histogram for the pool, rendered in the Prometheus text format.

Pure bookkeeping: no I/O, no event loop. The pool records, the server renders.
"""

from __future__ import annotations

import bisect
from collections import Counter

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics), O(log buckets) per observation."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):  # counts has +Inf too
            running += n
            out.append((f"{bound:g}", running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class PoolMetrics:
    """What the pool counts: calls by kind and status, latency, worker restarts."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()  # (kind, status) -> n
        self.latency = Histogram()  # submit -> answer, seconds, exec calls
        self.overloaded = 0
        self.worker_restarts = 0
        self.worker_deaths: Counter[str] = Counter()

    def record(self, kind: str, status: str, latency_s: float) -> None:
        self.calls[(kind, status)] += 1
        if kind == "exec":
            self.latency.observe(latency_s)


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {value:g}"
    return f"{name} {value:g}"


def render(m: PoolMetrics, gauges: dict[str, float], extra_counters: dict[str, float]) -> str:
    """Prometheus exposition text for ``m`` plus point-in-time ``gauges``."""
    out = ["# HELP sandbox_calls_total Calls answered, by kind and status.",
           "# TYPE sandbox_calls_total counter"]
    for (kind, status), n in sorted(m.calls.items()):
        out.append(_line("sandbox_calls_total", n, {"kind": kind, "status": status}))
    out += ["# HELP sandbox_call_latency_seconds Time from submission to answer (exec calls).",
            "# TYPE sandbox_call_latency_seconds histogram"]
    for le, n in m.latency.cumulative():
        out.append(_line("sandbox_call_latency_seconds_bucket", n, {"le": le}))
    out.append(_line("sandbox_call_latency_seconds_sum", m.latency.sum))
    out.append(_line("sandbox_call_latency_seconds_count", m.latency.count))
    out += ["# TYPE sandbox_overloaded_total counter",
            _line("sandbox_overloaded_total", m.overloaded),
            "# TYPE sandbox_worker_restarts_total counter",
            _line("sandbox_worker_restarts_total", m.worker_restarts)]
    for name, value in sorted(extra_counters.items()):
        out += [f"# TYPE {name} counter", _line(name, value)]
    for name, value in sorted(gauges.items()):
        out += [f"# TYPE {name} gauge", _line(name, value)]
    return "\n".join(out) + "\n"
