"""oneDNN pre-packed linear layers of the local engine: same products, follow the weights."""

from __future__ import annotations

import torch

from asyncrl.engine.local.packed import pack_linears


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def test_packed_layers_give_the_plain_products_and_follow_new_weights(tiny_model_factory):
    model = tiny_model_factory(0)
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    plain = _logits(model, ids)
    packed = pack_linears(model, torch.device("cpu"))
    if packed is None:  # no oneDNN in this torch build: nothing changed, nothing to test
        assert all("forward" not in m.__dict__ for m in model.modules())
        return
    assert packed.layers and all("forward" in m.__dict__ for m in packed.layers)
    torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-4, atol=1e-5)
    # new weights: stale until re-packed, the new model's products after
    other = tiny_model_factory(1)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())
    want = _logits(other, ids)
    assert not torch.allclose(_logits(model, ids), want, rtol=1e-3, atol=1e-3)
    packed.repack()
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-4, atol=1e-5)
    packed.unpack()
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-6, atol=1e-6)


def test_only_fp32_layers_on_a_cpu_are_packed(tiny_model_factory):
    model = tiny_model_factory(0).to(torch.bfloat16)
    assert pack_linears(model, torch.device("cpu")) is None
    assert pack_linears(tiny_model_factory(0), torch.device("meta")) is None


def test_the_config_key_reaches_the_engine(tiny_model_factory, tiny_tokenizer):
    from asyncrl.config.components import LocalEngineConfig
    from asyncrl.engine.registry import build_engines

    for on in (True, False):
        (eng,) = build_engines(LocalEngineConfig(packed_linears=on), model=tiny_model_factory(0),
                               tokenizer=tiny_tokenizer)
        assert (eng._packed is not None) == on
