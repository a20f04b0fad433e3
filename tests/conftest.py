"""Shared fixtures: a tiny tokenizer and a tiny random Qwen3 model, built locally (no download)."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

TINY_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,
}
"""A tiny Qwen3-MoE: 8 experts, 2 per token, both layers sparse."""


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        lines.append(
            f"What is {a} + {b}? <reason>Let me compute.</reason> ```python\nprint({a}+{b})\n```\n"
            f"```output\n{a + b}\n```\n <answer>\\boxed{{{a + b}}}</answer>"
        )
        lines.append('<tool_call>{"name": "python_code_with_standard_io", "arguments": '
                     f'{{"code": "print({a}*{b})", "input": ""}}}}</tool_call>')
    return lines


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test (the trainer and engine tests: their timing
    and summation order do not depend on the machine's cores), restored after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from asyncrl.modeling import train_tokenizer

    return train_tokenizer(_corpus(), vocab_size=512)


@pytest.fixture(scope="session")
def tiny_model_factory(tiny_tokenizer):
    """Call with a seed to get a fresh tiny random Qwen3 model (eval mode, fp32)."""
    from asyncrl.modeling import build_model

    def make(seed: int = 0):
        return build_model(TINY_QWEN3, tiny_tokenizer, seed=seed).eval()

    return make


@pytest.fixture(scope="session")
def tiny_moe_factory(tiny_tokenizer):
    """Call with a seed to get a fresh tiny random Qwen3-MoE model (eval mode, fp32)."""
    from asyncrl.modeling import build_model

    def make(seed: int = 0):
        return build_model(TINY_QWEN3_MOE, tiny_tokenizer, seed=seed).eval()

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer, tiny_model_factory) -> Path:
    """A tiny model and tokenizer saved in HF format."""
    from asyncrl.modeling import save

    return save(tiny_model_factory(0), tiny_tokenizer, tmp_path_factory.mktemp("tiny_model"))


def _read_wandb_records(run_root: Path) -> list:
    """The records of a W&B run's `.wandb` transaction log: a 7-byte header (`:W&B`, magic,
    version) then LevelDB-log framing (32 KiB blocks; 7-byte chunk headers: crc, length,
    type full/first/middle/last) around `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_root.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, parts, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            records.append(rec)
    return records


@pytest.fixture
def wandb_records():
    """`wandb_records(run_root)`: the records of the one W&B offline run under `run_root`."""
    return _read_wandb_records
