"""HTTP bodies between ``HttpSandboxClient`` and ``sandbox serve``, and their codecs.

``POST /v1/execute`` takes an ``ExecBatch`` and answers an ``ExecBatchResult`` (results in
request order) with HTTP 200, or an ``ErrorBody`` with 400 (malformed), 413 (batch too large)
or 503 (overloaded or shutting down; nothing was executed, safe to retry elsewhere).

With ``Accept: application/x-sandbox-stream+msgpack`` the 200 answer is a stream instead: one
frame per call, in completion order, as soon as that call is answered (4-byte little-endian
length, then msgpack ``[index, ExecResult]``). A slow call then never holds back the answers
of the fast calls batched with it; ``HttpSandboxClient`` always asks for the stream.

Liveness: a request with ``X-Sandbox-Heartbeat: SECONDS`` asks the node to write an empty frame
(a length of 0, no body) whenever that long passes with no result frame, so that a silent
connection means a dead node or link and never a long call or a queued batch. A node that does
so echoes the header in its 200 answer (the interval it uses, clamped to
``HEARTBEAT_RANGE_S``); one that does not echo it sends no heartbeats (an older node), and a
client must then allow for the batch's whole run time before calling it silent.
msgpack (``application/msgpack``) is the default; JSON (``application/json``) is accepted and
answered in kind, for curl and other languages.
"""

from __future__ import annotations

import struct

import msgspec

from .records import ExecRequest, ExecResult

MSGPACK = "application/msgpack"
JSON = "application/json"
STREAM = "application/x-sandbox-stream+msgpack"
FRAME = struct.Struct("<I")
HEARTBEAT = "X-Sandbox-Heartbeat"
HEARTBEAT_RANGE_S = (0.05, 30.0)


class ExecBatch(msgspec.Struct, frozen=True):
    requests: list[ExecRequest]


class ExecBatchResult(msgspec.Struct, frozen=True):
    results: list[ExecResult]


class ErrorBody(msgspec.Struct, frozen=True):
    error: str  # "overloaded" | "shutting_down" | "bad_request" | "batch_too_large"
    reason: str


class Codec:
    """Encoders/decoders for one content type (instances are reused: they cache state)."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type
        mod = msgspec.msgpack if content_type == MSGPACK else msgspec.json
        self._enc = mod.Encoder()
        self.batch = mod.Decoder(ExecBatch)
        self.result = mod.Decoder(ExecBatchResult)
        self.error = mod.Decoder(ErrorBody)
        self.frame = mod.Decoder(tuple[int, ExecResult])

    def encode(self, obj: object) -> bytes:
        return self._enc.encode(obj)


CODECS = {MSGPACK: Codec(MSGPACK), JSON: Codec(JSON)}


def heartbeat_interval(value: str | None) -> float | None:
    """The heartbeat interval a request's ``X-Sandbox-Heartbeat`` asks for, clamped to
    ``HEARTBEAT_RANGE_S``; None when absent or not a positive number."""
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return None
    if not seconds > 0:  # also NaN
        return None
    low, high = HEARTBEAT_RANGE_S
    return min(max(seconds, low), high)


def codec_for(content_type: str | None) -> Codec:
    """The codec for a Content-Type header (parameters ignored); msgpack when absent."""
    base = (content_type or MSGPACK).split(";")[0].strip().lower()
    return CODECS[JSON] if base.endswith("json") else CODECS[MSGPACK]
