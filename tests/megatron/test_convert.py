"""HF config -> Megatron architecture, and HF <-> Megatron weight layouts (no megatron needed)."""

from __future__ import annotations

import pytest
import torch
from mg_cases import FAMILIES, hf_config, hf_model

from asyncrl.trainer.megatron import convert
from asyncrl.trainer.megatron.arch import Arch
from asyncrl.trainer.megatron.errors import ConversionError, UnsupportedModelError


def test_qwen3_maps_to_megatron_options():
    arch = Arch.from_hf(hf_config("qwen3"))
    kw = arch.transformer_config_kwargs()
    assert kw["qk_layernorm"] is True and kw["normalization"] == "RMSNorm"
    assert kw["kv_channels"] == 16 and kw["num_query_groups"] == 2
    assert kw["gated_linear_unit"] is True and kw["add_bias_linear"] is False
    assert kw["add_qkv_bias"] is False and kw["layernorm_epsilon"] == 1e-6
    gpt = arch.gpt_model_kwargs()
    assert gpt["share_embeddings_and_output_weights"] is True
    assert gpt["rotary_base"] == 1_000_000.0 and gpt["position_embedding_type"] == "rope"


def test_families_differ_where_the_checkpoints_do():
    qwen2, llama = Arch.from_hf(hf_config("qwen2")), Arch.from_hf(hf_config("llama"))
    assert (qwen2.qkv_bias, qwen2.qk_norm) == (True, False)
    assert (llama.qkv_bias, llama.qk_norm, llama.tied_embeddings) == (False, False, False)
    assert llama.head_dim == 16 and llama.norm_eps == 1e-5


def test_parameter_count_matches_the_hf_model():
    for family in FAMILIES:
        model = hf_model(family)
        assert Arch.from_hf(model.config).num_params() == sum(
            p.numel() for p in model.parameters()), family


@pytest.mark.parametrize(("change", "field"), [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type"),
])
def test_unsupported_configs_name_the_field(change, field):
    cfg = hf_config("qwen3")
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(UnsupportedModelError) as e:
        Arch.from_hf(cfg)
    assert e.value.field == field


def test_a_split_that_does_not_divide_the_heads_is_refused():
    arch = Arch.from_hf(hf_config("qwen3"))
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        arch.check_parallel(tp=4, pp=1)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(family, tp):
    hf = hf_model(family).state_dict()
    arch = Arch.from_hf(hf_config(family))
    names = convert.megatron_names(arch)
    shards = [convert.hf_to_megatron(hf, names, arch, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = convert.megatron_to_hf(shards, arch)
    assert sorted(back) == sorted(convert.expected_hf_names(arch))
    for name, t in back.items():
        assert torch.equal(t, hf[name]), name


def test_te_layer_names_map_to_the_same_norms():
    hf = hf_model("qwen3").state_dict()
    arch = Arch.from_hf(hf_config("qwen3"))
    te = convert.hf_to_megatron(hf, convert.megatron_names(arch, transformer_engine=True), arch)
    w = te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"]
    assert torch.equal(w, hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(convert.megatron_to_hf([te], arch)["model.layers.0.input_layernorm.weight"],
                       hf["model.layers.0.input_layernorm.weight"])


def test_fused_layouts_are_megatrons():
    """linear_qkv: per query group, its query heads then its key then its value head, and a TP
    rank holds whole groups; linear_fc1: each rank holds [its gate slice; its up slice]."""
    hf = hf_model("qwen3_untied").state_dict()  # 8 heads, 2 groups, head_dim 8
    arch = Arch.from_hf(hf_config("qwen3_untied"))
    p = "model.layers.0."
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    rank1 = convert.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight",
                                hf.__getitem__, arch, tp_rank=1, tp_size=2)
    assert rank1.shape == (6 * 8, 48)  # one group: 4 query heads + k + v
    assert torch.equal(rank1[:32], q[32:64])
    assert torch.equal(rank1[32:40], k[8:16]) and torch.equal(rank1[40:48], v[8:16])
    fc1 = convert.to_megatron("decoder.layers.0.mlp.linear_fc1.weight", hf.__getitem__, arch,
                              tp_rank=1, tp_size=2)
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))


def test_pipeline_stage_layers_are_offset_and_bad_names_fail():
    arch = Arch.from_hf(hf_config("qwen3"))
    assert convert.hf_names("decoder.layers.0.mlp.linear_fc2.weight", arch, layer_offset=1) == (
        "model.layers.1.mlp.down_proj.weight",)
    with pytest.raises(ConversionError, match="no HF counterpart"):
        convert.hf_names("decoder.layers.0.mlp.router.weight", arch)
    with pytest.raises(ConversionError, match="lacks"):
        convert.hf_to_megatron({}, ["decoder.final_layernorm.weight"], arch)
