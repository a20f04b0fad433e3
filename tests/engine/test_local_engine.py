"""The local engine: greedy equals `model.generate`, KV budget, abort, weight updates, stops."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_cases import PROMPTS

from asyncrl.engine.base import Engine, GenerateRequest, SamplingParams, WeightUpdate, collect
from asyncrl.engine.local.engine import LocalEngine
from asyncrl.errors import EngineError, EngineUnavailable

N = 24


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def model(spiky_model_factory):
    return spiky_model_factory(0)


def _greedy_ref(model, ids: list[int], n: int = N) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def refs(model, tiny_tokenizer):
    ids = [tiny_tokenizer.encode(p) for p in PROMPTS]
    return ids, [_greedy_ref(model, x) for x in ids]


def _req(rid: str, ids: list[int], n: int = N, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, input_ids=ids,
                           sampling=SamplingParams(max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw))


async def test_is_an_engine(model, tiny_tokenizer) -> None:
    eng = LocalEngine(model, tiny_tokenizer, kv_token_budget=256, max_running=2)
    assert isinstance(eng, Engine)
    with pytest.raises(EngineUnavailable):  # not started
        await collect(eng, _req("x", [1, 2]))


async def test_greedy_alone_equals_generate(model, tiny_tokenizer, refs) -> None:
    ids, ref = refs
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=8) as eng:
        for i, (x, r) in enumerate(zip(ids, ref, strict=True)):
            g = await collect(eng, _req(f"a{i}", x))
            assert g.token_ids == r
            assert g.finish_reason == "length"
            assert all(lp <= 0 for lp in g.logprobs) and len(g.logprobs) == N


async def test_greedy_batched_and_staggered_equals_generate(model, tiny_tokenizer, refs) -> None:
    ids, ref = refs

    async def late(i: int, x: list[int]):
        await asyncio.sleep(0.005 * i)  # rows join a running batch at different steps
        return await collect(eng, _req(f"b{i}", x, n=N - 3 * i))

    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=8) as eng:
        outs = await asyncio.gather(*(late(i, x) for i, x in enumerate(ids)))
        assert eng.steps < sum(len(o.token_ids) for o in outs)  # they really shared steps
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o.token_ids == r[: N - 3 * i]
    assert all(len(set(r)) > 5 for r in ref)  # varied continuations: the check has teeth


async def test_rows_leave_and_join_in_place_and_still_equal_generate(model, tiny_tokenizer,
                                                                      refs) -> None:
    """Churn: 9 requests through 3 rows, each a different length, arriving while others run.
    Rows that finish stay in the cache as dead rows and the next requests move into them
    (including ones longer than the batch's width at the time); every output still equals
    `model.generate` alone, and the batch cache is not reallocated when a request moves in."""
    ids, _ = refs
    prompts = [ids[i % 5] * (1 + (i % 3 == 2) * 2) for i in range(9)]  # some 3x as long
    lens = [N - 2 * (i % 4) for i in range(9)]
    ref = [_greedy_ref(model, x, n) for x, n in zip(prompts, lens, strict=True)]
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=3) as eng:
        buffers: set[int] = set()

        async def late(i: int):
            await asyncio.sleep(0.004 * i)
            out = await collect(eng, _req(f"c{i}", prompts[i], n=lens[i]))
            layer = eng._batch.cache.layers[0] if eng._batch.rows else None
            if layer is not None and layer._kbuf is not None:
                buffers.add(layer._kbuf.data_ptr())
            return out

        outs = await asyncio.gather(*(late(i) for i in range(9)))
        assert eng.steps < sum(lens)  # they shared steps
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r
    assert len(buffers) < 9  # requests moved into existing rows instead of copying the cache


async def test_a_longer_request_moves_into_a_dead_row_without_a_copy(model, tiny_tokenizer,
                                                                     refs) -> None:
    ids, _ = refs
    short, long = ids[0], ids[4] * 3
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=2) as eng:
        # a long row trimmed by its leaving leaves spare columns in front of the buffer view
        keep = eng.stream(_req("keep", short, n=40))
        await keep.__anext__()  # running before the long one joins
        await collect(eng, _req("gone", long, n=3))
        layer = eng._batch.cache.layers[0]
        before = layer._kbuf.data_ptr()
        assert eng._batch.rows == 2  # the finished row is still there, dead
        out = await collect(eng, _req("in", long, n=8))
        assert layer._kbuf.data_ptr() == before  # moved in and widened as a view
        assert [d async for d in keep][-1].finish_reason == "length"
    assert out.token_ids == _greedy_ref(model, long, 8)


async def test_kv_budget_never_exceeded_under_pressure(model, tiny_tokenizer, refs) -> None:
    ids, ref = refs
    budget = 90  # far less than the 5 requests need together: admission waits and preemption
    seen: list[int] = []
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=budget, max_running=8,
                           admit_reserve=0) as eng:
        async def watch():
            while True:
                load = await eng.load()
                seen.append(load.kv_tokens_used)
                assert load.kv_tokens_capacity == budget
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            outs = await asyncio.gather(*(collect(eng, _req(f"k{i}", x)) for i, x in enumerate(ids)))
        finally:
            watcher.cancel()
        assert eng.peak_kv_tokens <= budget
        assert max(seen) <= budget
        assert eng.peak_kv_tokens > budget - 10  # the budget was actually the constraint
        assert eng.preemptions > 0
        assert (await eng.load()).kv_tokens_used == 0
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r  # preempted requests resume exactly (recomputed prefix)


async def test_request_that_can_never_fit_is_refused(model, tiny_tokenizer) -> None:
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=32, max_running=2) as eng:
        with pytest.raises(EngineError, match="budget"):
            await collect(eng, _req("big", list(range(10, 30)), n=20))


async def test_abort_frees_capacity_for_the_waiting(model, tiny_tokenizer, refs) -> None:
    ids, _ = refs
    x = ids[4] * 4  # a long prompt, so two of them do not fit in the budget together
    ref = _greedy_ref(model, x)
    budget = len(x) + 60
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=budget, max_running=4) as eng:
        first = eng.stream(_req("long", x, n=60))
        got = [await first.__anext__() for _ in range(5)]
        assert all(d.finish_reason is None for d in got)
        second = asyncio.create_task(collect(eng, _req("next", x, n=N)))
        await asyncio.sleep(0.05)
        load = await eng.load()
        assert load.running == 1 and load.waiting == 1  # no KV room for the second
        assert load.kv_tokens_used >= len(x) + 5
        await eng.abort("long")
        load = await eng.load()
        assert load.kv_tokens_used == 0 and load.running == 0  # released at once
        rest = [d async for d in first]
        assert rest[-1].finish_reason == "abort"
        out = await asyncio.wait_for(second, 30)
        assert out.token_ids == ref
        assert (await eng.load()).kv_tokens_used == 0


async def test_leaving_the_stream_aborts_the_request(model, tiny_tokenizer, refs) -> None:
    ids, _ = refs
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=1024, max_running=4) as eng:
        async def take_two():
            n = 0
            async for _ in eng.stream(_req("leave", ids[0], n=200)):
                n += 1
                if n == 2:
                    break
        await take_two()
        await asyncio.sleep(0.01)
        load = await eng.load()
        assert load.running == 0 and load.kv_tokens_used == 0


async def test_weight_update_changes_outputs_and_bumps_version(spiky_model_factory, tiny_tokenizer,
                                                               refs) -> None:
    ids, ref = refs
    other = spiky_model_factory(1)
    ref_other = _greedy_ref(other, ids[0])
    assert ref_other != ref[0]
    async with LocalEngine(spiky_model_factory(0), tiny_tokenizer, kv_token_budget=2048,
                           max_running=4) as eng:
        assert eng.policy_version == 0
        # an update while a request is streaming lands between steps and does not break it
        running = asyncio.create_task(collect(eng, _req("during", ids[1], n=60)))
        await asyncio.sleep(0.02)
        await eng.update_weights(WeightUpdate(version=1, state_dict=other.state_dict()))
        assert eng.policy_version == 1
        during = await running
        assert during.finish_reason == "length" and len(during.token_ids) == 60
        after = [d async for d in eng.stream(_req("after", ids[0]))]
        assert all(d.policy_version == 1 for d in after)
        assert [t for d in after for t in d.token_ids] == ref_other


async def test_weight_update_rejects_unknown_names(model, tiny_tokenizer) -> None:
    from asyncrl.errors import WeightSyncError

    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=256, max_running=2) as eng:
        with pytest.raises(WeightSyncError):
            await eng.update_weights(WeightUpdate(version=5, state_dict={"nope": torch.zeros(1)}))
        assert eng.policy_version == 0


async def test_stop_token_and_stop_string(model, tiny_tokenizer, refs) -> None:
    ids, ref = refs
    r = ref[4]
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=2048, max_running=4) as eng:
        stop_id = r[5]
        g = await collect(eng, _req("sid", ids[4], stop_token_ids=(stop_id,)))
        k = r.index(stop_id)
        assert g.token_ids == r[: k + 1] and g.finish_reason == "stop"
        # a stop string spanning tokens 6-7: output stops at the first token completing it
        before, text = tiny_tokenizer.decode(r[:7]), tiny_tokenizer.decode(r[:8])
        stop = text[len(before) - 1:]
        j = next(j for j in range(1, len(r) + 1) if stop in tiny_tokenizer.decode(r[:j]))
        assert j <= 8
        g = await collect(eng, _req("sstr", ids[4], stop_strings=(stop, "never-seen-string")))
        assert g.finish_reason == "stop" and g.token_ids == r[:j]


async def test_sampling_is_seeded_and_top_p_narrows(model, tiny_tokenizer, refs) -> None:
    ids, ref = refs
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=8) as eng:
        a, b, c = await asyncio.gather(
            collect(eng, _req("s1", ids[0], temperature=1.0, seed=7)),
            collect(eng, _req("s2", ids[0], temperature=1.0, seed=7)),
            collect(eng, _req("s3", ids[0], temperature=1.0, seed=8)),
        )
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.token_ids != c.token_ids
        assert all(lp <= 0 for lp in a.logprobs)
        # top_p that keeps only the top token is greedy
        g = await collect(eng, _req("s4", ids[0], temperature=0.7, top_p=1e-6, seed=1))
        assert g.token_ids == ref[0]


async def test_close_ends_open_streams_with_abort(model, tiny_tokenizer, refs) -> None:
    ids, _ = refs
    eng = await LocalEngine(model, tiny_tokenizer, kv_token_budget=1024, max_running=4).start()
    s = eng.stream(_req("open", ids[0], n=300))
    await s.__anext__()
    await eng.close()
    rest = [d async for d in s]
    assert rest and rest[-1].finish_reason == "abort"


async def test_weight_update_refuses_a_partial_or_misshapen_checkpoint(model, tiny_tokenizer
                                                                      ) -> None:
    # A wrong or partial checkpoint must never load silently, nor half-load before refusing.
    from asyncrl.errors import WeightSyncError

    before = {k: v.clone() for k, v in model.state_dict().items()}
    partial = {k: torch.zeros_like(v) for k, v in before.items()}
    dropped = next(k for k in partial if "layers.0" in k)
    del partial[dropped]
    misshapen = {k: torch.zeros_like(v) for k, v in before.items()}
    bent = next(k for k in misshapen if k.endswith("weight") and misshapen[k].dim() == 2)
    misshapen[bent] = torch.zeros(3, 3)
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=256, max_running=2) as eng:
        with pytest.raises(WeightSyncError, match=f"missing parameters.*{dropped}"):
            await eng.update_weights(WeightUpdate(version=1, state_dict=partial))
        with pytest.raises(WeightSyncError, match=rf"shape.*{bent}.*\(3, 3\)"):
            await eng.update_weights(WeightUpdate(version=2, state_dict=misshapen))
        assert eng.policy_version == 0
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded


async def test_weight_update_from_an_hf_export_with_tied_embeddings(model, tiny_tokenizer,
                                                                   tmp_path) -> None:
    # HF drops a tied lm_head.weight on save: its alias is in the file, so the update is whole
    from safetensors.torch import load_file

    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=256, max_running=2) as eng:
        await eng.update_weights(WeightUpdate(version=3, path=str(tmp_path)))
        assert eng.policy_version == 3


async def test_a_group_with_one_prompt_is_prefilled_once(model, tiny_tokenizer, refs) -> None:
    """Requests admitted together with the same context (a GRPO group) share one prefill row,
    both when they are appended and when they move into dead rows; each still decodes on its
    own: greedy equals `generate`, and seeded samples follow their own seeds."""
    ids, ref = refs
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0])
        if kw["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=8) as eng:
            greedy = [_req(f"g{i}", ids[i // 4]) for i in range(8)]  # two prompts, 4 each
            outs = await asyncio.gather(*(collect(eng, r) for r in greedy))
            assert rows == [2] and eng.prefills_shared == 6
            assert eng._batch.rows == 8  # the dead rows are still there: the next ones fill
            seeded = [_req(f"s{i}", ids[2], temperature=1.0, seed=i % 2) for i in range(4)]
            samples = await asyncio.gather(*(collect(eng, r) for r in seeded))
            assert rows == [2, 1] and eng.prefills_shared == 9
    finally:
        hook.remove()
    for i, o in enumerate(outs):
        assert o.token_ids == ref[i // 4]
    assert samples[0].token_ids == samples[2].token_ids  # same seed, same context
    assert samples[1].token_ids == samples[3].token_ids
    assert samples[0].token_ids != samples[1].token_ids  # rows sample on their own


async def test_a_draining_batch_drops_its_dead_rows(model, tiny_tokenizer, refs) -> None:
    """With nothing waiting, rows that stay dead are compacted away within a few steps, even
    while they are fewer than the live ones (they would cost a forward each step until the
    last request ends); outputs are unchanged."""
    from asyncrl.engine.local.plan import DRAIN_STEPS

    ids, ref = refs
    lens = [2, 3] + [N] * 5  # two leave early, six run on: the dead never outnumber the live
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=8) as eng:
        watch = eng.stream(_req("w", ids[4]))
        outs = asyncio.gather(*(collect(eng, _req(f"d{i}", ids[i % 4], n=n))
                                for i, n in enumerate(lens)))
        rows = [eng._batch.rows async for _ in watch]
        done = await outs
    assert max(rows) == 8 and rows[-1] == 6
    assert rows.index(6) <= lens[1] + DRAIN_STEPS + 2
    for i, (o, n) in enumerate(zip(done, lens, strict=True)):
        assert o.token_ids == ref[i % 4][:n]


async def test_an_idle_engine_drops_its_dead_rows_and_trims_the_heap(model, tiny_tokenizer,
                                                                    refs, monkeypatch) -> None:
    """After `RELEASE_IDLE_S` with no request (a wave or an evaluation ended), the batch's
    cache goes and the heap is trimmed (`asyncrl.allocator.release`); a brief pause keeps the
    dead rows for the next request; the next requests still equal `model.generate`."""
    from asyncrl.engine.local import engine as engine_mod

    released = []
    monkeypatch.setattr(engine_mod.allocator, "release", lambda: released.append(1) or True)
    monkeypatch.setattr(engine_mod, "RELEASE_IDLE_S", 0.2)
    ids, ref = refs
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=4) as eng:
        await asyncio.gather(*(collect(eng, _req(f"i{i}", ids[i])) for i in range(3)))
        assert eng._batch.rows == 3 and not released  # just idle: the dead rows stay
        for _ in range(100):
            await asyncio.sleep(0.05)
            if released:
                break
        assert released == [1]
        assert eng._batch.rows == 0 and eng._batch.cache is None and eng._planner.rows == []
        outs = await asyncio.gather(*(collect(eng, _req(f"j{i}", ids[i])) for i in range(3, 5)))
        await asyncio.sleep(0.5)
        assert released == [1, 1]  # once per idle spell, not once per wait
    for o, r in zip(outs, ref[3:5], strict=True):
        assert o.token_ids == r


async def test_release_drops_an_idle_batch_now_and_waits_for_a_busy_one(model, tiny_tokenizer,
                                                                         refs) -> None:
    """`release()` (a synchronous run, before the trainer's step) drops the dead rows' cache
    at once when nothing runs; while a request runs it changes nothing; later requests still
    equal `model.generate`."""
    ids, ref = refs
    async with LocalEngine(model, tiny_tokenizer, kv_token_budget=4096, max_running=4) as eng:
        await asyncio.gather(*(collect(eng, _req(f"r{i}", ids[i])) for i in range(3)))
        assert eng._batch.rows == 3
        assert await eng.release() is True
        assert eng._batch.rows == 0 and eng._batch.cache is None
        busy = eng.stream(_req("busy", ids[3]))
        first = await busy.__anext__()
        assert await eng.release() is False and eng._batch.rows == 1
        rest = [d async for d in busy]
        out = await collect(eng, _req("after", ids[4]))
    assert [first.token_ids[0]] + [d.token_ids[0] for d in rest] == ref[3]
    assert out.token_ids == ref[4]
