"""The local engine on a mixture-of-experts model (Qwen3-MoE): greedy output equals
`model.generate`, batched and under preemption, and the routing it records (routing replay) is
what the model's own forward over the finished sequence chooses, token by token and layer by
layer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engine_cases import PROMPTS

from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.errors import EngineError
from asyncrl.modeling import routers

N = 20


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def moe(tiny_moe_factory):
    """Weights re-drawn with std 0.2: varied, context-dependent greedy output and routing."""
    m = tiny_moe_factory(0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2, generator=g)
    return m.eval()


def own_routing(model, ids: list[int]) -> np.ndarray:
    """`[len(ids), layers, top_k]`: the experts the model's routers choose over `ids` alone."""
    got = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: got.append(out[2]))
             for r in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got, dim=1).numpy()


def decoded(rec) -> np.ndarray:
    return np.frombuffer(rec.data, dtype=np.uint8).reshape(rec.tokens, rec.layers, rec.top_k)


async def _run(model, tok, *, budget: int, sample: bool) -> tuple[list, LocalEngine]:
    import copy

    async def one(e, i, text):
        ids = tok.encode(text)
        sp = SamplingParams(max_new_tokens=N, temperature=1.0 if sample else 0.0, seed=i)
        out, rec = [], None
        async for d in e.stream(GenerateRequest(request_id=f"r{i}", input_ids=ids, sampling=sp)):
            out += d.token_ids
            if d.finish_reason is not None:
                rec = d.routed_experts
        return ids, out, rec

    async with LocalEngine(copy.deepcopy(model), tok, kv_token_budget=budget, max_running=8,
                           record_routing=True) as e:
        res = await asyncio.gather(*(one(e, i, p) for i, p in enumerate(PROMPTS * 2)))
    return res, e


@pytest.mark.parametrize("budget", [4096, 90])
async def test_greedy_equals_generate_and_records_own_routing(moe, tiny_tokenizer, budget):
    res, engine = await _run(moe, tiny_tokenizer, budget=budget, sample=False)
    if budget == 90:
        assert engine.preemptions > 0  # the re-prefill path restarts the record
    for ids, out, rec in res:
        ref = moe.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                           dtype=torch.long), max_new_tokens=N, do_sample=False,
                           eos_token_id=None)[0, len(ids):].tolist()
        assert out == ref
        assert rec.tokens == len(ids) + len(out) - 1  # the last token is never fed back
        want = own_routing(moe, ids + out[:-1])
        got = decoded(rec)
        same = (np.sort(got, -1) == np.sort(want, -1)).all(-1)
        assert same.mean() >= 0.995, f"{(~same).sum()} of {same.size} (token, layer) differ"


async def test_sampled_records_follow_the_sampled_tokens(moe, tiny_tokenizer):
    res, _ = await _run(moe, tiny_tokenizer, budget=4096, sample=True)
    for ids, out, rec in res:
        want = own_routing(moe, ids + out[:-1])
        same = (np.sort(decoded(rec), -1) == np.sort(want, -1)).all(-1)
        assert same.mean() >= 0.995
    # the records differ between requests: they are each request's own, not one copied
    assert len({decoded(r).tobytes() for _, _, r in res}) > len(PROMPTS)


async def test_dense_model_is_refused(tiny_model_factory, tiny_tokenizer):
    with pytest.raises(EngineError, match="mixture-of-experts"):
        LocalEngine(tiny_model_factory(0), tiny_tokenizer, kv_token_budget=256, max_running=2,
                    record_routing=True)


async def test_no_record_unless_asked(moe, tiny_tokenizer):
    async with LocalEngine(moe, tiny_tokenizer, kv_token_budget=1024, max_running=2) as e:
        sp = SamplingParams(max_new_tokens=4, temperature=0.0)
        last = None
        async for d in e.stream(GenerateRequest(request_id="a", input_ids=[5, 6, 7],
                                                sampling=sp)):
            last = d
    assert last is not None and last.routed_experts is None


async def test_updates_by_checkpoint_names_load_into_fused_experts(tiny_moe_factory,
                                                                   tiny_tokenizer, tmp_path):
    """What `save_pretrained`, the Megatron trainer and SGLang name each expert's matrices
    (`mlp.experts.E.gate_proj.weight`, ...) loads into transformers' fused in-memory experts,
    from disk and as tensors; an update missing an expert is refused. Each engine runs a
    fresh model: the module's `moe` may already hold an earlier engine's packed (mkldnn)
    linears, which cannot be deep-copied."""
    from safetensors.torch import load_file

    from asyncrl.engine.base import WeightUpdate, collect
    from asyncrl.errors import WeightSyncError
    from asyncrl.modeling import save

    new = tiny_moe_factory(5)
    save(new, tiny_tokenizer, tmp_path)
    on_disk = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk
    ids = tiny_tokenizer.encode(PROMPTS[0])
    want = new.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                        dtype=torch.long), max_new_tokens=N, do_sample=False,
                        eos_token_id=None)[0, len(ids):].tolist()
    sp = SamplingParams(max_new_tokens=N, temperature=0.0)
    for i, update in enumerate([WeightUpdate(version=1, path=str(tmp_path)),
                                WeightUpdate(version=2, state_dict=on_disk)]):
        async with LocalEngine(tiny_moe_factory(1), tiny_tokenizer, kv_token_budget=1024,
                               max_running=2) as e:
            await e.update_weights(update)
            got = await collect(e, GenerateRequest(request_id=f"u{i}", input_ids=ids,
                                                   sampling=sp))
        assert got.token_ids == want
    partial = {k: v for k, v in on_disk.items() if ".experts.7." not in k}
    async with LocalEngine(tiny_moe_factory(1), tiny_tokenizer, kv_token_budget=1024,
                           max_running=2) as e:
        with pytest.raises(WeightSyncError, match="missing parameters"):
            await e.update_weights(WeightUpdate(version=3, state_dict=partial))
