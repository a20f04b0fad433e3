"""The memory model behind `trainer.recompute = "auto"`: figures for real Qwen3 shapes, and the
cheapest recompute that fits is chosen."""

from __future__ import annotations

import pytest

from asyncrl.trainer.megatron import memory
from asyncrl.trainer.megatron.arch import Arch

GIB = 2**30
H100 = 79.2 * GIB  # what torch reports for an 80 GB H100

QWEN3 = {  # public configs (head_dim 128, tied embeddings, vocab 151,936)
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8),
}


def arch(size: str) -> Arch:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=True,
                               **QWEN3[size])
    return Arch.from_hf(cfg)


def test_bf16_state_is_18_bytes_per_parameter_and_dp_shards_the_optimizer():
    a = arch("1.7b")
    one = memory.estimate(a, micro_batch_tokens=8192, recompute="none", bf16=True)
    assert one.weights_and_optimizer == pytest.approx(18 * a.num_params())
    four = memory.estimate(a, micro_batch_tokens=8192, recompute="none", bf16=True, dp=4)
    assert four.weights_and_optimizer == pytest.approx((6 + 3) * a.num_params())
    fp32 = memory.estimate(a, micro_batch_tokens=8192, recompute="none", bf16=False)
    assert fp32.weights_and_optimizer == pytest.approx(16 * a.num_params())  # no master copy


def test_recompute_shrinks_activations_in_order():
    a = arch("1.7b")
    acts = [memory.estimate(a, micro_batch_tokens=8192, recompute=k, bf16=True).activations
            for k in memory.RECOMPUTE_ORDER]
    assert acts[0] > acts[1] > acts[2] > 0
    assert 15 * GIB < acts[0] < 20 * GIB  # ~0.6 MiB per token over 28 layers, no recompute
    with pytest.raises(ValueError, match="recompute"):
        memory.estimate(a, micro_batch_tokens=8192, recompute="some", bf16=True)


@pytest.mark.parametrize(("size", "tokens", "device", "expect", "fits"), [
    ("0.6b", 16384, H100, "none", True),
    ("1.7b", 8192, H100, "none", True),
    ("1.7b", 16384, H100, "selective", True),
    ("1.7b", 8192, 54 * GIB, "selective", True),
    ("1.7b", 8192, 48 * GIB, "full", True),
    ("1.7b", 8192, 40 * GIB, "full", False),
    # 72 GB of weights and optimizer state, 16 GB more at the optimizer step: needs the
    # optimizer state sharded or offloaded, or TP
    ("4b", 4096, H100, "full", False),
])
def test_choose_recompute_takes_the_cheapest_that_fits(size, tokens, device, expect, fits):
    got, need, ok = memory.choose_recompute(arch(size), device_bytes=device,
                                            micro_batch_tokens=tokens, bf16=True)
    assert (got, ok) == (expect, fits)
    assert ok == (need.total <= device * (1 - memory.HEADROOM))


def test_the_optimizer_step_transient_can_set_the_peak():
    a = arch("4b")
    e = memory.estimate(a, micro_batch_tokens=4096, recompute="full", bf16=True)
    assert e.optimizer_step == pytest.approx(4 * a.num_params())
    assert e.total == pytest.approx(e.weights_and_optimizer + e.optimizer_step)
    two = memory.estimate(a, micro_batch_tokens=4096, recompute="full", bf16=True, dp=2)
    assert two.optimizer_step == pytest.approx(2 * a.num_params())
