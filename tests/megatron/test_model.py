"""The megatron-core model built from a HF config: weights round-trip exactly, and its logits
and log-probabilities equal the HF model's (fp32, CPU, one process)."""

from __future__ import annotations

import pytest
import torch
from mg_cases import FAMILIES, VOCAB, hf_model

from asyncrl.trainer.megatron.arch import Arch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                                        "ignore::DeprecationWarning:megatron")


def build(family: str):
    from asyncrl.trainer.megatron import model as mm

    hf = hf_model(family).eval()
    arch = Arch.from_hf(hf.config)
    mm.init_parallel(1, 1, seed=0)
    model = mm.build_gpt(arch)
    sd = hf.state_dict()
    mm.load_hf_weights(model, arch, sd.__getitem__)
    return hf, arch, model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_and_logits_equal_hf(cpu_megatron, family):
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron import vocab_parallel

    hf, arch, model = build(family)
    out = dict(mm.iter_hf_weights(model, arch))
    ref = hf.state_dict()
    assert set(out) == {k for k in ref if not (arch.tied_embeddings and k == "lm_head.weight")}
    for k, t in out.items():
        assert torch.equal(t, ref[k]), k

    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = mm.forward_logits(model, ids)
        expect = hf(input_ids=ids).logits
        torch.testing.assert_close(logits, expect, atol=2e-5, rtol=1e-5)
        lp = vocab_parallel.token_logprobs(logits, ids, temperature=0.7)
        from asyncrl.algo.loss import token_entropy, token_logprobs

        torch.testing.assert_close(lp, token_logprobs(expect, ids, 0.7), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(vocab_parallel.token_entropy(logits, 0.7),
                                   token_entropy(expect / 0.7), atol=2e-5, rtol=1e-5)


def test_vocab_parallel_fused_entropy_equals_the_torch_path_with_gradients(cpu_megatron):
    from asyncrl.algo.loss import token_logprobs_and_entropy
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron import vocab_parallel

    mm.init_parallel(1, 1, seed=0)
    g = torch.Generator().manual_seed(6)
    x = (3.0 * torch.randn(2, 13, VOCAB, generator=g)).requires_grad_()
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    w = torch.randn(2, 13, generator=g)
    lp, ent = vocab_parallel.token_logprobs_and_entropy(x, ids, 0.7, chunk=5)
    assert not ent.requires_grad
    (lp * w).sum().backward()
    grad, x.grad = x.grad.clone(), None
    ref_lp, ref_ent = token_logprobs_and_entropy(x, ids, 0.7)
    (ref_lp * w).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=2e-6, rtol=0)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=0)


def test_right_padding_does_not_change_real_positions(cpu_megatron):
    from asyncrl.trainer.megatron import model as mm

    _, _, model = build("qwen3")
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(mm.forward_logits(model, padded)[:, :9],
                                   mm.forward_logits(model, ids), atol=1e-6, rtol=1e-6)


def test_export_loads_in_transformers_with_the_same_logits(cpu_megatron, tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron.hf_files import HFReader, write_hf

    hf, arch, model = build("qwen3_untied")
    # Tiny shards force a multi-file checkpoint with an index.
    write_hf(tmp_path, mm.iter_hf_weights(model, arch), hf.config, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)
    reader = HFReader(tmp_path)
    assert torch.equal(reader("lm_head.weight"), hf.state_dict()["lm_head.weight"])
