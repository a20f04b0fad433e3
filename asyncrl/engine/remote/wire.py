"""Wire helpers shared by the HTTP engines: SSE framing and Prometheus text parsing.

Owns: splitting a `text/event-stream` body into event payloads, and reading gauges from a
Prometheus `/metrics` page (summed over data-parallel ranks, not over the tensor-parallel
ranks that repeat the same value). Pure functions and a small buffer class; no I/O.
"""

from __future__ import annotations


class SSEDecoder:
    """Splits a `text/event-stream` body into the payloads of its `data:` lines.

    Frames can be far larger than aiohttp's line limit (SGLang's non-incremental stream
    repeats the whole output in every event), so this buffers bytes itself.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out: list[bytes] = []
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                return out
            frame, self._buf = self._buf[:cut], self._buf[cut + 2:]
            data = [line[5:].lstrip() for line in frame.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition → {metric name: [(labels, value), ...]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:
            name, rest = line.split("{", 1)
            body, _, tail = rest.rpartition("}")
            for part in _split_labels(body):
                k, _, v = part.partition("=")
                labels[k.strip()] = v.strip().strip('"')
        else:
            name, _, tail = line.partition(" ")
        try:
            value = float(tail.split()[0])
        except (IndexError, ValueError):
            continue
        out.setdefault(name.strip(), []).append((labels, value))
    return out


def _split_labels(body: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    quoted = False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def gauge(metrics: dict[str, list[tuple[dict[str, str], float]]], *names: str,
          per: str = "") -> float | None:
    """Value of the first of `names` present: summed over distinct values of label `per`
    (data-parallel ranks), max over the rest (tensor-parallel ranks repeat the same value)."""
    for name in names:
        if name in metrics:
            groups: dict[str, float] = {}
            for labels, value in metrics[name]:
                key = labels.get(per, "") if per else ""
                groups[key] = max(groups.get(key, value), value)
            return sum(groups.values())
    return None
