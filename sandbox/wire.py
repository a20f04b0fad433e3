"""HTTP bodies between ``HttpSandboxClient`` and ``sandbox serve``, and their codecs.

``POST /v1/execute`` takes an ``ExecBatch`` and answers an ``ExecBatchResult`` (results in
request order) with HTTP 200, or an ``ErrorBody`` with 400 (malformed), 413 (batch too large)
or 503 (overloaded or shutting down; nothing was executed, safe to retry elsewhere).

With ``Accept: application/x-sandbox-stream+msgpack`` the 200 answer is a stream instead: one
frame per call, in completion order, as soon as that call is answered (4-byte little-endian
length, then msgpack ``[index, ExecResult]``). A slow call then never holds back the answers
of the fast calls batched with it; ``HttpSandboxClient`` always asks for the stream.
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


def codec_for(content_type: str | None) -> Codec:
    """The codec for a Content-Type header (parameters ignored); msgpack when absent."""
    base = (content_type or MSGPACK).split(";")[0].strip().lower()
    return CODECS[JSON] if base.endswith("json") else CODECS[MSGPACK]
