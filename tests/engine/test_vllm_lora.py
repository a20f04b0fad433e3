"""The vllm engine's LoRA edges: the server's reason when it refuses a LoRA call, read
from each error body vLLM 0.32 sends, and the adapter cache a launched LoRA server gets."""

from __future__ import annotations

import json

from asyncrl.engine.vllm.engine import error_message


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


def _argv(*extra: str) -> list[str]:
    from asyncrl.config import VLLMEngineConfig
    from asyncrl.engine.vllm.engine import VLLMEngine

    eng = VLLMEngine(VLLMEngineConfig(extra_args=list(extra)), index=0, port=8000,
                     model_path="m")
    return eng._argv("m")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_launched_lora_server_caches_several_adapters() -> None:
    # With vLLM's default cache of one adapter, loading version N evicts N-1 while requests
    # sent under it still run, and vLLM reloads it from a directory push_weights has removed:
    # the server's EngineCore dies (the real-server test shows it).
    assert _flag(_argv("--enable-lora", "--max-lora-rank", "8"), "--max-cpu-loras") == "8"
    assert _flag(_argv("--enable-lora", "--max-loras", "16"), "--max-cpu-loras") == "16"
    assert _flag(_argv("--enable-lora", "--max-loras=2"), "--max-cpu-loras") == "8"
    argv = _argv("--enable-lora", "--max-cpu-loras", "3")
    assert argv.count("--max-cpu-loras") == 1 and _flag(argv, "--max-cpu-loras") == "3"
    assert "--max-cpu-loras" not in _argv("--dtype", "float32")  # no LoRA: vLLM's defaults


def test_a_relaunch_from_a_weight_export_takes_the_launch_models_tokenizer() -> None:
    # A tied-embedding update relaunches the server from the trainer's export, a directory
    # with weights and config only: vLLM then found no tokenizer there (SmolLM2's Llama
    # tokenizer needs its files) and the relaunch failed.
    from asyncrl.config import VLLMEngineConfig
    from asyncrl.engine.vllm.engine import VLLMEngine

    eng = VLLMEngine(VLLMEngineConfig(), index=0, port=8000, model_path="base")
    assert _flag(eng._argv("base"), "--tokenizer") is None
    assert _flag(eng._argv("run/weights/v1"), "--tokenizer") == "base"
    assert _flag(eng._argv("run/weights/v1"), "--model") == "run/weights/v1"
    for given in (["--tokenizer", "tok"], ["--tokenizer=tok"], ["--skip-tokenizer-init"]):
        eng = VLLMEngine(VLLMEngineConfig(extra_args=given), index=0, port=8000,
                         model_path="base")
        assert eng._argv("run/weights/v1").count("--tokenizer") == given.count("--tokenizer")
