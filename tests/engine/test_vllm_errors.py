"""What the vllm engine reports when the server refuses a LoRA call: the server's reason, read
from each error body vLLM 0.32 sends (its own, and FastAPI's for a route that is off)."""

from __future__ import annotations

import json

from asyncrl.engine.vllm import error_message


def test_vllm_0_32s_nested_error_gives_its_message() -> None:
    # serving.py `create_error_response` -> ErrorResponse(error=ErrorInfo(...)).model_dump()
    raw = json.dumps({"error": {"message": "Loading lora asyncrl-v4 failed: No adapter found "
                                "for /runs/x/weights/v4/adapter", "type": "NotFoundError",
                                "param": None, "code": 404}}).encode()
    assert error_message(raw) == ("Loading lora asyncrl-v4 failed: No adapter found for "
                                  "/runs/x/weights/v4/adapter")


def test_other_bodies_give_their_reason_or_text() -> None:
    assert error_message(b'{"message": "already loaded"}') == "already loaded"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"Internal Server Error") == "Internal Server Error"
    assert error_message(b'["odd"]') == '["odd"]'
    assert len(error_message(b"x" * 5000)) == 500
