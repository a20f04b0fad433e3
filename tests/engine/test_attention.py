"""The local engine's attention (`asyncrl.engine.local.attention`): one-token GQA steps packed
instead of repeating the key/value heads, equal to the repeated form; installed on the
engine's own model only when it uses `sdpa` with grouped heads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from asyncrl.engine.local import attention
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.modeling import train_tokenizer


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _repeated(query, key, value, mask, scale):
    """The form transformers 5.17 runs with a mask: every KV head repeated per query head."""
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per_head", "none"])
def test_a_packed_one_token_step_equals_the_repeated_heads(mask_kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, width, dim = 5, 8, 2, 40, 16
    q = torch.randn(b, heads, 1, dim, generator=g)
    k = torch.randn(b, kv_heads, width, dim, generator=g)
    v = torch.randn(b, kv_heads, width, dim, generator=g)
    lens = torch.tensor([40, 7, 1, 23, 31])
    keep = (torch.arange(width)[None, :] < lens[:, None]).view(b, 1, 1, width)
    mask = {"bool": keep,
            "additive": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min),
            "per_head": keep.expand(b, heads, 1, width) & (torch.rand(b, heads, 1, width,
                                                                      generator=g) > 0.3)
            | (torch.arange(width) == 0).view(1, 1, 1, width),
            "none": None}[mask_kind]
    out, weights = attention.decode_attention(_Module(heads // kv_heads), q, k, v, mask,
                                              scaling=0.25)
    assert weights is None and out.shape == (b, 1, heads, dim)
    torch.testing.assert_close(out, _repeated(q, k, v, mask, 0.25), rtol=0, atol=2e-6)


def test_a_longer_query_is_transformers_own_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mod = _Module(2)
    ours, _ = attention.decode_attention(mod, q, k, v, None, scaling=0.5)
    theirs, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.5)
    assert torch.equal(ours, theirs)


def _model(kv_heads: int, impl: str = "sdpa") -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                      vocab_size=300, attn_implementation=impl)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("decode", ["eager", "static"])
async def test_the_engine_installs_it_on_its_own_model_and_decodes_as_before(decode) -> None:
    from asyncrl.engine.base import GenerateRequest, SamplingParams, collect

    tok = train_tokenizer(["What is 12 plus 7? print(12 + 7)"] * 20, vocab_size=300)
    model = _model(kv_heads=2)
    reference = copy.deepcopy(model)
    prompts = [[5, 9, 13, 200, 7], [3, 4], [150, 151, 152, 153, 154, 155, 156, 8]]
    async with LocalEngine(model, tok, kv_token_budget=256, max_running=4,
                           decode=decode) as eng:
        assert model.config._attn_implementation == attention.NAME
        outs = [await collect(eng, GenerateRequest(
            request_id=f"r{i}", input_ids=p,
            sampling=SamplingParams(max_new_tokens=6, temperature=0.0)))
            for i, p in enumerate(prompts)]
    assert reference.config._attn_implementation == "sdpa"  # only the engine's model
    for p, out in zip(prompts, outs, strict=True):
        want = reference.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)
        assert out.token_ids == want[0, len(p):].tolist()


def test_models_it_does_not_help_are_left_alone() -> None:
    for model in (_model(kv_heads=4), _model(kv_heads=2, impl="eager")):
        before = model.config._attn_implementation
        assert attention.install(model) is False
        assert model.config._attn_implementation == before
