"""The local engine's fixed-shape decode (`decode = "static"`) against the eager one and
`model.generate`: greedy outputs identical, seeded sampling identical, through rows joining and
leaving, preemption, the cache growing and weight updates; its sampler against `sample_rows`;
the config key; the CUDA-graph capture (marked `gpu`)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_cases import PROMPTS

from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.engine.local.sampling import sample_rows
from asyncrl.engine.local.static import bucket, buckets, sample_fixed
from asyncrl.errors import ConfigError, EngineError


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model(spiky_model_factory):
    return spiky_model_factory(0)


def _spiky(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2, generator=g)
    return model.eval()


@pytest.fixture(scope="module")
def vocab_model():
    """A small Qwen3 from a config with the real 151,936-token vocabulary (sampling over it is
    what the static sampler must reproduce), untied embeddings, 4 heads on 2 KV heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      vocab_size=151936, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return _spiky(Qwen3ForCausalLM(cfg), 7)


def _ref(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                          dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _req(rid: str, ids: list[int], n: int, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=ids, sampling=SamplingParams(
        max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw))


async def _staggered(eng: LocalEngine, prompts: list[list[int]], lens: list[int], **kw):
    async def late(i: int):
        await asyncio.sleep(0.004 * i)  # rows join a running batch at different steps
        return await collect(eng, _req(f"r{i}", prompts[i], lens[i], **kw))

    return await asyncio.gather(*(late(i) for i in range(len(prompts))))


def _ids(tok) -> list[list[int]]:
    return [tok.encode(p) for p in PROMPTS]


# ----------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("which", ["tiny", "vocab"])
async def test_greedy_static_equals_eager_and_generate(which, model, vocab_model,
                                                       tiny_tokenizer) -> None:
    m = model if which == "tiny" else vocab_model
    prompts = [x * (1 + (i % 3 == 2) * 2) for i, x in enumerate(_ids(tiny_tokenizer))]
    lens = [24 - 3 * i for i in range(len(prompts))]
    ref = [_ref(m, x, n) for x, n in zip(prompts, lens, strict=True)]
    assert len({tuple(r) for r in ref}) == len(ref) and all(len(set(r)) > 3 for r in ref)
    got = {}
    for decode in ("eager", "static"):
        async with LocalEngine(m, tiny_tokenizer, kv_token_budget=4096, max_running=8,
                               decode=decode) as eng:
            got[decode] = [o.token_ids for o in await _staggered(eng, prompts, lens)]
            assert eng.steps < sum(lens)  # they shared steps
            if decode == "static":
                rows = {k[0] for k in eng._batch.shapes}
                assert len(rows) > 1  # the batch moved between row buckets
    assert got["static"] == ref
    assert got["eager"] == ref


async def test_rows_join_leave_and_are_preempted(model, tiny_tokenizer) -> None:
    """Churn: 6 requests through 3 rows under a KV budget that forces preemption: every
    output still equals `model.generate` alone."""
    ids = _ids(tiny_tokenizer)
    prompts = [ids[i % 5] * (1 + (i % 3 == 2) * 2) for i in range(6)]
    lens = [16 - 2 * (i % 4) for i in range(6)]
    ref = [_ref(model, x, n) for x, n in zip(prompts, lens, strict=True)]
    budget = max(len(x) + n for x, n in zip(prompts, lens, strict=True)) + 20
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=budget, max_running=3,
                           admit_reserve=0, decode="static") as eng:
        outs = await _staggered(eng, prompts, lens)
        assert eng.preemptions > 0
        assert eng.peak_kv_tokens <= budget
    assert [o.token_ids for o in outs] == ref


async def test_the_cache_grows_mid_run_and_outputs_still_match(model, tiny_tokenizer) -> None:
    """A row decoding past the buffers' 64 columns, and a longer request joining while it
    runs, widen the static buffers (a copy) without changing any output."""
    ids = _ids(tiny_tokenizer)
    short, long = ids[0], (ids[4] * 8)[:100]
    ref_short, ref_long = _ref(model, short, 70), _ref(model, long, 10)
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=4,
                           decode="static") as eng:
        stream = eng.stream(_req("short", short, 70))
        first = [await stream.__anext__() for _ in range(3)]  # running before the long joins

        async def rest() -> list[int]:
            return [t for d in first for t in d.token_ids] + [
                t async for d in stream for t in d.token_ids]

        running = asyncio.create_task(rest())
        assert eng._batch.width == 64
        joined = await collect(eng, _req("long", long, 10))
        assert eng._batch.width == 128
        assert await running == ref_short
        widths = {k[1] for k in eng._batch.shapes}
    assert joined.token_ids == ref_long
    assert widths >= {64, 128}


# --------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("which", ["tiny", "vocab"])
async def test_seeded_sampling_is_identical_to_eager(which, model, vocab_model,
                                                     tiny_tokenizer) -> None:
    """Mixed rows in one batch (greedy, temperatures, seeds, and top-p on the tiny model):
    the same tokens from both paths, log-probs within float noise. The paths' logits differ by
    float noise (another attention width), so a draw within that noise of a token boundary may
    differ; over the 151,936-token vocabulary a top-p row makes every sampled row draw in
    sorted order, where tail tokens of near-equal probability swap places under that noise
    (seen: two tokens of log-prob -15.1 swapped), so that model's batch has no top-p row. The
    sampler itself is checked bit for bit below."""
    m = model if which == "tiny" else vocab_model
    ids = _ids(tiny_tokenizer)
    kinds = [dict(temperature=1.0, seed=3), dict(temperature=0.7, seed=4),
             dict(temperature=0.0), dict(temperature=1.3, seed=5), dict(temperature=1.0, seed=6)]
    if which == "tiny":
        kinds[1] = dict(temperature=0.7, top_p=0.9, seed=4)
    got = {}
    for decode in ("eager", "static"):
        async with LocalEngine(m, tiny_tokenizer, kv_token_budget=4096, max_running=8,
                               decode=decode) as eng:
            got[decode] = await asyncio.gather(*(collect(eng, _req(f"s{i}", x, 20, **k))
                                                 for i, (x, k) in enumerate(zip(ids, kinds,
                                                                                strict=True))))
    for e, s in zip(got["eager"], got["static"], strict=True):
        assert s.token_ids == e.token_ids
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    assert len({tuple(o.token_ids) for o in got["static"]}) == len(ids)


@pytest.mark.parametrize("top_p", [False, True])
def test_the_fixed_sampler_is_sample_rows(top_p) -> None:
    """Same logits, same generators: `sample_fixed` gives `sample_rows`' tokens and log-probs,
    bit for bit, over a vocabulary that does not split into whole blocks."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 7, 1000
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[2, 5] = float("-inf")
    temps = [0.0, 1.0, 0.5, 1.0, 2.0, 0.0, 1.0]
    tops = [1.0, 1.0, 0.8 if top_p else 1.0, 1.0, 1.0, 1.0, 1.0]

    def gens():
        return [None if i % 2 else torch.Generator().manual_seed(i) for i in range(rows)]

    want_t, want_lp = sample_rows(logits, temps, tops, gens(), torch.Generator().manual_seed(9))
    sampled = [i for i, t in enumerate(temps) if t]
    from asyncrl.engine.local.sampling import _uniforms

    u = torch.zeros(rows)
    u[sampled] = _uniforms([gens()[i] for i in sampled], torch.Generator().manual_seed(9))
    toks, lps = sample_fixed(logits, torch.tensor(temps), torch.tensor(tops), u, top_p)
    assert [int(t) for t in toks] == want_t
    assert lps.tolist() == want_lp
    if not top_p:  # every sampled row at temperature 1: the division is left out, same draws
        ones = [0.0 if t == 0 else 1.0 for t in temps]
        want_t1, want_lp1 = sample_rows(logits, ones, tops, gens(),
                                        torch.Generator().manual_seed(9))
        toks, lps = sample_fixed(logits, torch.tensor(ones), torch.tensor(tops), u, False,
                                 scaled=False)
        assert [int(t) for t in toks] == want_t1 and lps.tolist() == want_lp1
    assert len(set(want_t)) > 3


def test_buckets() -> None:
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert buckets(256, 64) == [64, 128, 256]
    assert bucket(5, buckets(100)) == 8 and bucket(65, buckets(100)) == 100
    with pytest.raises(ValueError):
        bucket(101, buckets(100))


# ---------------------------------------------------------------- weights, attention, config
async def test_weight_update_between_static_steps(spiky_model_factory, tiny_tokenizer) -> None:
    ids = _ids(tiny_tokenizer)
    other = spiky_model_factory(1)
    ref_other = _ref(other, ids[0], 24)
    async with LocalEngine(spiky_model_factory(0), tiny_tokenizer, kv_token_budget=2048,
                           max_running=4, decode="static") as eng:
        running = asyncio.create_task(collect(eng, _req("during", ids[1], 60)))
        await asyncio.sleep(0.02)
        await eng.update_weights(WeightUpdate(version=1, state_dict=other.state_dict()))
        during = await running
        assert during.finish_reason == "length" and len(during.token_ids) == 60
        after = await collect(eng, _req("after", ids[0], 24))
    assert after.token_ids == ref_other


async def test_eager_attention_gets_an_additive_mask(tiny_tokenizer) -> None:
    from asyncrl.modeling import build_model
    from tests.conftest import TINY_QWEN3

    m = _spiky(build_model({**TINY_QWEN3, "attn_implementation": "eager"}, tiny_tokenizer,
                           seed=0), 1000)
    m.config._attn_implementation = "eager"
    ids = _ids(tiny_tokenizer)
    ref = [_ref(m, x, 16) for x in ids]
    async with LocalEngine(m, tiny_tokenizer, kv_token_budget=2048, max_running=8,
                           decode="static") as eng:
        assert eng._batch._additive
        outs = await asyncio.gather(*(collect(eng, _req(f"e{i}", x, 16))
                                      for i, x in enumerate(ids)))
    assert [o.token_ids for o in outs] == ref


def test_bad_decode_and_routing_are_refused(model, tiny_tokenizer, tiny_moe_factory) -> None:
    from asyncrl import config
    from asyncrl.config.components import LocalEngineConfig
    from asyncrl.engine.registry import build_engines
    from tests.config.test_config import minimal

    with pytest.raises(ConfigError) as ei:
        config.from_dict(config.apply_overrides(minimal(), ['engine.decode="graph"']))
    assert ei.value.key == "engine.decode"
    assert config.from_dict(config.apply_overrides(minimal(), ['engine.decode="static"'])
                            ).engine.decode == "static"
    with pytest.raises(EngineError, match="decode"):
        LocalEngine(model, tiny_tokenizer, kv_token_budget=64, max_running=2, decode="graph")
    with pytest.raises(EngineError, match="routing"):
        LocalEngine(tiny_moe_factory(0), tiny_tokenizer, kv_token_budget=64, max_running=2,
                    decode="static", record_routing=True)
    cfg = LocalEngineConfig(decode="static")
    with pytest.raises(ConfigError, match=r"engine\.decode"):
        build_engines(cfg, model=tiny_moe_factory(0), tokenizer=tiny_tokenizer,
                      record_routing=True)
    eng = build_engines(cfg, model=model, tokenizer=tiny_tokenizer)[0]
    assert type(eng._batch).__name__ == "StaticBatch"


# ------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_graph_capture_replays_like_eager(spiky_model_factory,
                                                     tiny_tokenizer) -> None:
    """On CUDA the static step is captured once per shape and replayed: greedy equals the
    eager engine and `model.generate` on the same device, seeded sampling equals eager, and a
    weight update after capture reaches the replayed graphs."""
    m = spiky_model_factory(0).cuda()
    ids = _ids(tiny_tokenizer)
    lens = [24 - 3 * i for i in range(len(ids))]
    ref = [_ref(m, x, n) for x, n in zip(ids, lens, strict=True)]
    got, sampled = {}, {}
    for decode in ("eager", "static"):
        async with LocalEngine(m, tiny_tokenizer, kv_token_budget=4096, max_running=8,
                               device="cuda", decode=decode) as eng:
            got[decode] = [o.token_ids for o in await _staggered(eng, ids, lens)]
            sampled[decode] = await asyncio.gather(*(collect(eng, _req(
                f"s{i}", x, 16, temperature=1.0, seed=i)) for i, x in enumerate(ids)))
            if decode == "static":
                assert eng._batch.graphs and eng._batch.captures >= 2
                other = spiky_model_factory(1).cuda()
                await eng.update_weights(WeightUpdate(version=1, state_dict=other.state_dict()))
                after = await collect(eng, _req("after", ids[0], 24))
                assert after.token_ids == _ref(other, ids[0], 24)
    assert got["static"] == ref and got["eager"] == ref
    for e, s in zip(sampled["eager"], sampled["static"], strict=True):
        assert s.token_ids == e.token_ids
