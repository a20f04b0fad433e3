"""The local engine's continuation cache (`engine.prefix_cache_tokens`): a request that continues
one that stopped (a tool call's next turn) prefills only its new tokens, and its output is what
`model.generate` gives on the whole context."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_cases import PROMPTS, greedy_reference

from asyncrl.engine.base import GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.engine.local.prefix import MIN_REUSE, PrefixStore
from asyncrl.errors import EngineError

N = 16
TOOL = [5, 9, 17, 33, 2, 8]  # a tool output's tokens, appended after the stopped turn
DECODES = ["eager", "static"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model(spiky_model_factory):  # the engine tests' context-dependent tiny model
    return spiky_model_factory(0)


def _generate(model, ids: list[int], n: int = N) -> list[int]:
    return greedy_reference(model, ids, n)


def _req(rid: str, ids: list[int], n: int = N, stop: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=ids, sampling=SamplingParams(
        max_new_tokens=n, temperature=0.0, stop_token_ids=stop or []))


def _prompts(tok) -> list[list[int]]:
    """Prompts long enough that their first turn is worth keeping (MIN_REUSE tokens)."""
    return [tok.encode(p * 4)[:40] for p in PROMPTS]


def _stop_at(ref: list[int]) -> int:
    """A token of `ref` whose first occurrence is at least 3 tokens in: a stop there ends a
    turn mid-answer."""
    return next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])


async def _two_turns(eng, model, prompts: list[list[int]], tag: str) -> None:
    """Every prompt: a first turn that stops, then a continuation with a tool output after it;
    both equal `generate` on their whole context."""
    stops = [_stop_at(_generate(model, p)) for p in prompts]
    first = await asyncio.gather(*(collect(eng, _req(f"{tag}{i}a", p, stop=[s]))
                                   for i, (p, s) in enumerate(zip(prompts, stops, strict=True))))
    for p, s, f in zip(prompts, stops, first, strict=True):
        assert f.finish_reason == "stop" and f.token_ids[-1] == s
        assert f.token_ids == _generate(model, p)[:len(f.token_ids)]
    nexts = [p + f.token_ids + TOOL for p, f in zip(prompts, first, strict=True)]
    second = await asyncio.gather(*(collect(eng, _req(f"{tag}{i}b", c))
                                    for i, c in enumerate(nexts)))
    for c, o in zip(nexts, second, strict=True):
        assert o.token_ids == _generate(model, c)


@pytest.mark.parametrize("decode", DECODES)
async def test_continuations_prefill_only_their_new_tokens(model, spiky_model_factory,
                                                          tiny_tokenizer, decode) -> None:
    """Five rollouts stop, then continue together with a tool output: each continuation takes
    its own kept turn (every token but the last sampled one), the prefill feeds only the new
    tokens, and greedy output equals `generate` on the whole context."""
    prompts = _prompts(tiny_tokenizer)
    fed: list[int] = []
    served = spiky_model_factory(0)  # the same weights; `model` computes the references
    hook = served.register_forward_pre_hook(
        lambda _m, _a, kw: fed.append(int(kw["input_ids"].shape[1]))
        if kw["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        async with LocalEngine(served, tiny_tokenizer, kv_token_budget=4096, max_running=8,
                               decode=decode, prefix_cache_tokens=4096) as eng:
            await _two_turns(eng, model, prompts, "r")
            assert eng.prefix is not None and eng.prefix.hits == len(prompts)
            assert len(eng.prefix) == 0 and eng.prefix.held == 0  # each taken once
    finally:
        hook.remove()
    # the first turns' prefill fed whole prompts, the continuations' only the last sampled
    # token and the tool output
    assert fed[0] == max(len(p) for p in prompts)
    assert fed[1:] == [1 + len(TOOL)]


async def test_mixed_prefill_of_continuations_and_new_prompts(model, tiny_tokenizer) -> None:
    """A prefill with continuations (kept prefixes of different lengths) and fresh prompts
    together, then decoding beside rows already running: every output equals `generate`."""
    prompts = _prompts(tiny_tokenizer)
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=8192, max_running=16,
                           prefix_cache_tokens=4096) as eng:
        stops = [_stop_at(_generate(model, p)) for p in prompts[:3]]
        first = await asyncio.gather(*(collect(eng, _req(f"m{i}", p, stop=[s]))
                                       for i, (p, s) in enumerate(zip(prompts, stops, strict=False))))
        running = asyncio.ensure_future(collect(eng, _req("run", prompts[4], n=3 * N)))
        await asyncio.sleep(0.02)  # it is decoding when the mixed prefill arrives
        ctxs = ([p + f.token_ids + TOOL[:i + 1] for i, (p, f) in enumerate(zip(prompts, first, strict=False))]
                + [prompts[3], prompts[0][:20]])
        outs = await asyncio.gather(*(collect(eng, _req(f"n{i}", c)) for i, c in enumerate(ctxs)))
        assert eng.prefix.hits == 3
        assert (await running).token_ids == _generate(model, prompts[4], 3 * N)
    for c, o in zip(ctxs, outs, strict=True):
        assert o.token_ids == _generate(model, c)


async def test_a_prompt_sharing_only_the_system_prompt_leaves_the_kept_turn_to_its_own(
        model, tiny_tokenizer) -> None:
    """Another problem's prompt shares the system prompt's tokens with every kept turn: it
    reuses them and leaves the turn in the store, so the request the turn was kept for still
    prefills only its new tokens when its tool call returns (a partial match once took the
    turn away, and the continuation prefilled its whole context)."""
    p, other = _prompts(tiny_tokenizer)[:2]
    shared = p[:20]  # a system prompt both problems start with
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=4,
                           prefix_cache_tokens=4096) as eng:
        f = await collect(eng, _req("a", p, stop=[_stop_at(_generate(model, p))]))
        kept = len(p) + len(f.token_ids) - 1  # every token but the last sampled one
        b = shared + other[:20]
        ob = await collect(eng, _req("b", b))  # a new problem: 20 tokens in common
        assert (eng.prefix.hits, eng.prefix.reused_tokens) == (1, 20)
        ctx = p + f.token_ids + TOOL
        oa = await collect(eng, _req("a2", ctx))  # the turn's own continuation
        assert (eng.prefix.hits, eng.prefix.reused_tokens) == (2, 20 + kept)
    assert ob.token_ids == _generate(model, b) and oa.token_ids == _generate(model, ctx)


async def test_a_continuation_that_rewrote_its_turn_reuses_the_common_prefix(
        model, tiny_tokenizer) -> None:
    """A client that rolled back the end of its turn (tokens dropped, others in their place)
    still gets the keys of what the two share, and the right answer."""
    p = _prompts(tiny_tokenizer)[1]
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=4,
                           prefix_cache_tokens=4096) as eng:
        f = await collect(eng, _req("w", p, stop=[_stop_at(_generate(model, p))]))
        ctx = p + f.token_ids[:-2] + TOOL
        o = await collect(eng, _req("w2", ctx))
        assert eng.prefix.reused_tokens == len(p) + len(f.token_ids) - 2
    assert o.token_ids == _generate(model, ctx)


async def test_new_weights_drop_the_kept_turns(spiky_model_factory, tiny_tokenizer) -> None:
    """Kept keys were computed by the old weights: after an update the continuation is
    prefilled whole, and equals the new model's `generate`."""
    model, other = spiky_model_factory(0), spiky_model_factory(1)
    p = _prompts(tiny_tokenizer)[0]
    async with LocalEngine(spiky_model_factory(0), tiny_tokenizer, kv_token_budget=4096,
                           max_running=4, prefix_cache_tokens=4096) as eng:
        f = await collect(eng, _req("u", p, stop=[_stop_at(_generate(model, p))]))
        assert len(eng.prefix) == 1
        await eng.update_weights(WeightUpdate(version=1, state_dict=other.state_dict()))
        assert len(eng.prefix) == 0
        ctx = p + f.token_ids + TOOL
        o = await collect(eng, _req("u2", ctx))
        assert eng.prefix.hits == 0
    assert o.token_ids == _generate(other, ctx)


def test_store_budget_matching_and_expiry() -> None:
    s = PrefixStore(capacity=100)
    kv = [(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))]
    a, b, c = list(range(40)), list(range(100, 140)), list(range(200, 240))
    s.put(a, kv, 0)
    s.put(b, kv, 0)
    s.put(c, kv, 0)  # over 100 tokens: the oldest (a) goes
    assert len(s) == 2 and s.held == 80
    assert s.take([*a, 1, 2], 0) is None
    assert s.take([*b, 7], 1) is None  # another policy version
    s.put(list(range(MIN_REUSE - 1)), kv, 0)  # too short to be worth taking: not kept
    s.put(list(range(101)), kv, 0)  # longer than the whole budget: not kept
    assert s.held == 80
    entry, n = s.take([*b[:30], 999], 0)  # a common prefix, not the whole entry: it stays
    assert n == 30 and entry.tokens == b and s.held == 80 and s.hits == 1
    entry, n = s.take([*b, 7], 0)  # its own continuation: the whole entry, which then goes
    assert n == 40 and entry.tokens == b and s.held == 40 and s.hits == 2
    assert s.take(c, 0)[1] == len(c) - 1  # never the context's last token
    assert s.held == 40  # (so c stayed)
    s.put(a, kv, 0)
    s.expire(0.0)
    assert len(s) == 0 and s.held == 0


def test_refused_with_routing_records(model, tiny_tokenizer) -> None:
    with pytest.raises(EngineError, match="routing"):
        LocalEngine(model, tiny_tokenizer, kv_token_budget=256, max_running=2,
                    prefix_cache_tokens=256, record_routing=True)


def test_common_prefix_lengths() -> None:
    from asyncrl.engine.local.prefix import _common

    a = list(range(300))
    for cut in (0, 1, 17, 150, 299):
        b = [*a[:cut], -1, *a[cut + 1:]]
        assert _common(a, b, 1000) == cut
    assert _common(a, a, 1000) == 300 and _common(a, a, 40) == 40
    assert _common(a, a[:10], 1000) == 10 and _common([], a, 5) == 0
