"""`GrowingLayer`: in-place appends into one buffer, trims as views, adoption of new tensors,
bounded headroom; `BatchCache` keeps one buffer per layer as rows join and leave."""

from __future__ import annotations

import weakref

import torch
from transformers import LlamaConfig

from asyncrl.engine.local.batch import BatchCache
from asyncrl.engine.local.kvcache import _SPARE, GROW_MAX, GrowingLayer, growing_cache

_CFG = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=4, vocab_size=16)


def _kv(rows: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)


def test_decode_steps_append_in_place_and_equal_concatenation() -> None:
    layer = GrowingLayer()
    k0, v0 = _kv(3, 10)
    layer.update(k0, v0)
    buf = layer._kbuf
    ks, vs = [k0], [v0]
    for i in range(20):
        k, v = _kv(3, 1, seed=i + 1)
        keys, values = layer.update(k, v)
        ks.append(k)
        vs.append(v)
        assert layer._kbuf is buf  # 10 + 20 columns fit the first buffer: no reallocation
    torch.testing.assert_close(keys, torch.cat(ks, dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat(vs, dim=2), rtol=0, atol=0)


def test_a_leading_trim_is_kept_as_a_view_and_full_buffers_grow() -> None:
    layer = GrowingLayer()
    k0, v0 = _kv(2, 8)
    layer.update(k0, v0)
    buf = layer._kbuf
    layer.keys, layer.values = layer.keys[:, :, 3:], layer.values[:, :, 3:]  # the engine's trim
    k, v = _kv(2, 1, seed=5)
    keys, _ = layer.update(k, v)
    assert layer._kbuf is buf
    torch.testing.assert_close(keys, torch.cat([k0[:, :, 3:], k], dim=2), rtol=0, atol=0)
    big_k, big_v = _kv(2, 200, seed=6)  # past the capacity: one copy into a larger buffer
    keys, _ = layer.update(big_k, big_v)
    assert layer._kbuf is not buf and layer._kbuf.shape[2] > 206
    torch.testing.assert_close(keys, torch.cat([k0[:, :, 3:], k, big_k], dim=2), rtol=0, atol=0)


def test_assigned_tensors_are_adopted() -> None:
    layer = GrowingLayer()
    k0, v0 = _kv(4, 6)
    layer.update(k0, v0)
    idx = torch.tensor([0, 2])  # the engine selects rows with index_select
    layer.keys, layer.values = k0.index_select(0, idx), v0.index_select(0, idx)
    k, v = _kv(2, 1, seed=9)
    keys, values = layer.update(k, v)
    assert keys.shape == (2, 2, 7, 4)
    torch.testing.assert_close(values, torch.cat([v0.index_select(0, idx), v], dim=2),
                               rtol=0, atol=0)


def test_a_fresh_buffer_grows_by_at_most_grow_max_columns() -> None:
    layer = GrowingLayer()
    k, v = _kv(1, 1000)
    layer.update(k, v)
    # half again (1564 columns) would hold 500 columns no decode step may ever write
    assert layer._kbuf.shape[2] == 1000 + GROW_MAX + _SPARE
    small = GrowingLayer()
    small.update(*_kv(1, 10))
    assert small._kbuf.shape[2] == 10 + 5 + _SPARE  # short buffers still grow by half


def test_replace_copies_into_a_fresh_buffer_and_frees_the_old_one_at_once() -> None:
    layer = GrowingLayer()
    k0, v0 = _kv(4, 6)
    layer.update(k0, v0)
    old = weakref.ref(layer._kbuf)
    idx = torch.tensor([1, 3])
    nk, nv = k0.index_select(0, idx), v0.index_select(0, idx)
    layer.replace(nk.clone(), nv.clone())
    assert old() is None  # not kept until the next decode step
    assert layer._offset_in_buffer() == 0  # a view of the new buffer
    buf = layer._kbuf
    k, v = _kv(2, 1, seed=3)
    keys, values = layer.update(k, v)
    assert layer._kbuf is buf  # the decode step writes in place
    torch.testing.assert_close(keys, torch.cat([nk, k], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([nv, v], dim=2), rtol=0, atol=0)


def test_batch_rows_appended_or_compacted_live_in_one_buffer_per_layer() -> None:
    """`BatchCache.append` and `compact` leave each layer one buffer (the old one and the
    prefill's freed), holding what concatenation would."""
    batch = BatchCache()
    first, second = growing_cache(_CFG), growing_cache(_CFG)
    k1, v1 = _kv(2, 5, seed=1)
    k2, v2 = _kv(3, 8, seed=2)
    for layer in first.layers:
        layer.update(k1, v1)
    for layer in second.layers:
        layer.update(k2, v2)
    batch.append(first, torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 5]))
    old = [weakref.ref(layer._kbuf) for layer in batch.cache.layers]
    prefill = [weakref.ref(layer._kbuf) for layer in second.layers]
    batch.append(second, torch.ones(3, 8, dtype=torch.long), torch.tensor([8, 8, 8]))
    assert all(r() is None for r in old + prefill)
    want = torch.cat([torch.nn.functional.pad(k1, (0, 0, 3, 0)), k2], dim=0)
    for layer in batch.cache.layers:
        assert layer._offset_in_buffer() is not None
        torch.testing.assert_close(layer.keys, want, rtol=0, atol=0)
    before = [weakref.ref(layer._kbuf) for layer in batch.cache.layers]
    batch.compact([4, 0])
    assert all(r() is None for r in before)
    for layer in batch.cache.layers:
        assert layer._offset_in_buffer() is not None
        torch.testing.assert_close(layer.keys, want.index_select(0, torch.tensor([4, 0])),
                                   rtol=0, atol=0)
