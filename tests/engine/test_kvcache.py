"""`GrowingLayer`: in-place appends into one buffer, trims as views, adoption of new tensors."""

from __future__ import annotations

import torch

from asyncrl.engine.local.kvcache import GrowingLayer


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
