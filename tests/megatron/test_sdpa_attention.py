"""`SDPACoreAttention` equals megatron-core's `DotProductAttention` and the HF model: outputs and
gradients in fp32 on the CPU, for the core alone (GQA, every mask type, layer scaling) and for
whole models built on each core (logits, and the gradient of every weight)."""

from __future__ import annotations

import pytest
import torch
from mg_cases import VOCAB, hf_model

from asyncrl.trainer.megatron.arch import Arch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron",
                                        "ignore::DeprecationWarning:megatron")

TOL = dict(atol=1e-5, rtol=1e-5)


def transformer_config(heads: int = 8, groups: int = 2, head_dim: int = 16, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=heads * head_dim, kv_channels=head_dim,
                             num_attention_heads=heads, num_query_groups=groups,
                             use_cpu_initialization=True, masked_softmax_fusion=False,
                             attention_dropout=0.0, **kw)


def cores(mask_type, layer_number: int = 1, **kw):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron.sdpa_attention import SDPACoreAttention

    mm.init_parallel(1, 1, seed=0)
    config = transformer_config(**kw)
    args = dict(config=config, layer_number=layer_number, attn_mask_type=mask_type,
                attention_type="self", softmax_scale=None, cp_comm_type=None)
    return SDPACoreAttention(**args), DotProductAttention(**args)


def qkv(s: int = 12, b: int = 3, heads: int = 8, groups: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    # key and value as strided views of one fused tensor, like `Attention` hands them over
    kv = torch.randn(s, b, groups, 2 * d, generator=g)
    k, v = kv[..., :d].clone(), kv[..., d:].clone()
    return q, k.requires_grad_(), v.requires_grad_()


def run(core, q, k, v, mask, **kw):
    out = core(q, k, v, mask, **kw)
    g = torch.Generator().manual_seed(9)
    out.backward(torch.randn(out.shape, generator=g))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], **TOL)
    for ga, gb in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(ga, gb, **TOL)


def causal(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]


@pytest.mark.parametrize(("groups", "layer_scaling"), [(2, False), (8, False), (2, True)],
                         ids=["gqa", "mha", "layer_scaling"])
def test_causal_equals_dot_product_attention(cpu_megatron, groups, layer_scaling):
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, local = cores(AttnMaskType.causal, layer_number=3, groups=groups,
                        apply_query_key_layer_scaling=layer_scaling)
    q, k, v = qkv(groups=groups)
    # The fused core ignores the mask under `causal`; megatron's needs it (its default is on CUDA).
    mine = run(sdpa, q, k, v, None)
    ref = run(local, q, k, v, causal(q.shape[0]))
    assert mine[0].shape == (12, 3, 8 * 16)
    assert_same(mine, ref)


def test_padding_masks_equal_dot_product_attention(cpu_megatron):
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, local = cores(AttnMaskType.padding)
    q, k, v = qkv()
    s = q.shape[0]
    pad = torch.zeros(3, 1, 1, s, dtype=torch.bool)  # right padding: rows of 12, 9 and 5 keys
    pad[1, ..., 9:] = True
    pad[2, ..., 5:] = True
    assert_same(run(sdpa, q, k, v, pad), run(local, q, k, v, pad))
    both = pad | causal(s)
    mine = run(sdpa, q, k, v, pad, attn_mask_type=AttnMaskType.padding_causal)
    assert_same(mine, run(local, q, k, v, both))
    # a per-call mask type overrides the constructor's, as in megatron's `Attention`
    assert_same(run(sdpa, q, k, v, None, attn_mask_type=AttnMaskType.causal),
                run(local, q, k, v, causal(s)))


def test_no_mask_attends_everywhere(cpu_megatron):
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, local = cores(AttnMaskType.no_mask)
    q, k, v = qkv()
    nothing = torch.zeros(1, 1, 12, 12, dtype=torch.bool)
    assert_same(run(sdpa, q, k, v, None), run(local, q, k, v, nothing))


def test_unsupported_inputs_are_clear_errors(cpu_megatron):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, _ = cores(AttnMaskType.padding)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="needs an attention_mask"):
        sdpa(q, k, v, None)
    with pytest.raises(NotImplementedError, match="packed"):
        sdpa(q, k, v, None, attn_mask_type=AttnMaskType.causal,
             packed_seq_params=PackedSeqParams(qkv_format="thd"))


# ------------------------------------------------------------------------------ whole models
def build(hf, attention: str, recompute: str = "none"):
    from asyncrl.trainer.megatron import model as mm

    arch = Arch.from_hf(hf.config)
    model = mm.build_gpt(arch, attention=attention, recompute=recompute)
    mm.load_hf_weights(model, arch, hf.state_dict().__getitem__)
    return arch, model


def weight_grads(model, arch, ids, mask):
    """HF-named gradients of a masked log-prob sum through the model."""
    from asyncrl.trainer.megatron import convert, vocab_parallel
    from asyncrl.trainer.megatron import model as mm

    logits = mm.forward_logits(model, ids)
    (vocab_parallel.token_logprobs(logits, ids, 0.8) * mask).sum().backward()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out.update(convert.to_hf(name, [p.grad], arch))
    return logits.detach(), out


def test_models_on_each_core_give_the_same_logits_and_gradients_as_hf(cpu_megatron):
    from asyncrl.algo.loss import token_logprobs
    from asyncrl.trainer.megatron import model as mm

    hf = hf_model("qwen3_untied")  # 4:1 GQA, head_dim != hidden / heads
    mm.init_parallel(1, 1, seed=0)
    ids = torch.randint(2, VOCAB, (3, 17), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 17)
    mask[1, 11:] = 0  # a right-padded row
    mask[:, 0] = 0

    arch, sdpa = build(hf, "sdpa")
    assert mm.core_attention(sdpa) == "sdpa" and mm.causal_mask(sdpa, 17, ids.device) is None
    _, local = build(hf, "local")
    assert mm.core_attention(local) == "local"
    _, sdpa_recompute = build(hf, "sdpa", recompute="selective")  # recomputes the MLP

    logits, grads = weight_grads(sdpa, arch, ids, mask)
    ref_logits, ref_grads = weight_grads(local, arch, ids, mask)
    _, recompute_grads = weight_grads(sdpa_recompute.train(), arch, ids, mask)
    hf_logits = hf(input_ids=ids).logits
    (token_logprobs(hf_logits, ids, 0.8) * mask).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}

    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(logits, hf_logits.detach(), atol=2e-5, rtol=1e-5)
    assert grads.keys() == hf_grads.keys()
    for k, g in grads.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(g, ref_grads[k], **TOL, msg=k)
        torch.testing.assert_close(g, recompute_grads[k], **TOL, msg=k)
        torch.testing.assert_close(g, hf_grads[k], atol=2e-5, rtol=1e-4, msg=k)


def test_auto_takes_sdpa_without_transformer_engine(cpu_megatron):
    from asyncrl.trainer.megatron import model as mm
    from asyncrl.trainer.megatron.errors import MegatronUnavailableError

    assert not mm.use_transformer_engine()  # no CUDA here
    assert mm.resolve_attention("auto") == "sdpa"
    with pytest.raises(MegatronUnavailableError, match="transformer_engine"):
        mm.resolve_attention("te")
    with pytest.raises(ValueError, match="flash"):
        mm.resolve_attention("flash")
