"""The local engine's fixed-shape decode (`decode = "static"`): a preallocated KV cache, one
decode step whose shapes come from a few buckets, sampling on the device, CUDA graphs on CUDA.

Owns: the running batch's KV cache when the engine decodes statically (`StaticBatch`: the same
row operations as `batch.BatchCache`, which the engine's plan drives the same way), the decode
step over it, and its capture and replay as one CUDA graph per shape. Does not own: which
request is in which row (the plan), prefill (eager, as in `engine._prefill`, whose left-padded
cache is copied in here), stop rules, or the host-side random draws (`sampling._uniforms`).

Layout. Every attention layer has one key and one value buffer `[rows, kv heads, width, dim]`
(rows: `max_running`; width: a power of two >= 64 that holds the longest context seen, grown,
a copy, when a longer one arrives). Row r holds its request's context right-padded from column
0, so a token's column is its position id: the step's write index, its position ids and its
attention mask (`column <= position`) all come from one `[rows]` tensor of positions. Rows leave
and join without moving anything but their own columns; there are no shared padding columns to
trim or widen, unlike the eager path's left-padded cache. A dead row (its request left) and the
rows a bucket pads with sit at position 0: they write a dummy key at column 0 and attend to it
alone, so their outputs are finite and discarded. HF's `StaticCache` (transformers 5) keeps one
write position for the whole batch (`cumulative_length`), which a continuous batch cannot use;
this is its per-row variant, given to the model as a cache with its own layers and a ready 4-D
mask (HF returns such a mask as is).

The step. Its inputs are copied into fixed device buffers (token ids and positions; per row the
uniform draw, temperature and top-p), then one call computes, with every shape fixed by
`(rows bucket, width bucket, top-p on, a temperature other than 1)`: the forward of one token
per row over the first `rows bucket` rows and `width bucket` columns, and the sampling of
`sampling.sample_rows` written without a host sync (same arithmetic, so the same tokens and log-probs from the same
logits and uniforms), into a fixed output buffer; one device->host copy brings the ids and
log-probs back. Buckets: rows 1, 2, 4, ... up to `max_running` (the last bucket is
`max_running` itself); width 64, 128, ... up to the buffers' width. That is how SGLang's and
vLLM's CUDA-graph runners do it (fixed input buffers, the batch padded up to a captured size,
one graph memory pool shared by every capture); they page the KV cache under their own
attention kernels, where this path keeps HF's attention and so a dense per-row cache.

CUDA graphs (`graphs=True`, a CUDA device): the first step of a shape runs the step once on a
side stream (warm-up), captures it into a `torch.cuda.CUDAGraph` (one memory pool for all) and
replays it; later steps of that shape only copy the inputs in, replay and copy out. The warm-up
and capture use the real step's inputs: a step writes, at each row's position, exactly the key
and value the replay writes again, so capturing mid-run changes nothing. Weight updates copy
into the parameters in place (`load_state_dict`, the adapter merge), so captured graphs read
the new weights; the cache buffers are replaced only when they grow, and then every graph is
dropped and recaptured. On a CPU the same fixed-shape step runs without capture.

Costs: memory is `max_running` x width for every layer whatever the rows hold (the eager path
holds the live rows' longest context; a paged cache would hold only what is used); attention
reads the whole width bucket of every row. Refused: MoE routing records (the engine refuses
`record_routing` with this path), attention other than `sdpa` or `eager`, sliding windows (the
engine refuses those for both paths).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from asyncrl.engine.local import attention
from asyncrl.engine.local.sampling import NEG_LOGPROB, _block_sums, _pick, _sample_top_p, _uniforms
from asyncrl.errors import EngineError

MIN_WIDTH = 64
"""The narrowest width bucket (and the buffers' first width)."""

ATTENTION = ("sdpa", attention.NAME, "eager")
"""Attention implementations whose mask this path can build (`attention.NAME` is `sdpa` with
one-token GQA steps packed)."""


def buckets(limit: int, first: int = 1) -> list[int]:
    """`first`, 2 x `first`, ... while below `limit`, then `limit`: the captured sizes."""
    out, b = [], first
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest size in `sizes` (ascending) that holds `n`."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} is over the largest bucket {sizes[-1]}")


class _RowLayer(DynamicLayer):
    """One layer's view of the static buffers for the step in progress: `update` writes each
    row's new key and value at that row's position (`index`) and returns the bucket's view."""

    def __init__(self) -> None:
        super().__init__()
        self.index: torch.Tensor | None = None  # [rows bucket, heads, 1, dim], int64

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None and self.index is not None
        self.keys.scatter_(2, self.index, key_states)
        self.values.scatter_(2, self.index[..., :1].expand_as(value_states), value_states)
        return self.keys, self.values


class StaticBatch:
    """The running batch's fixed-shape KV cache and decode step (see the module docstring).

    `StaticBatch(model, device, max_rows=, pad_id=, graphs=False, name="")`: `max_rows` is the
    engine's `max_running`; `graphs` captures the step as CUDA graphs (CUDA devices only).
    The row operations (`free`, `compact`, `trim`, `fill`, `append`, `rows`) mean what
    `batch.BatchCache`'s do; `decode` runs one step."""

    def __init__(self, model: Any, device: torch.device, *, max_rows: int, pad_id: int,
                 graphs: bool = False, name: str = "") -> None:
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in ATTENTION:
            raise EngineError(f"{name}: the static decode builds masks for {list(ATTENTION)} "
                              f"attention; the model uses {impl!r}")
        if graphs and device.type != "cuda":
            raise EngineError(f"{name}: CUDA graphs need a CUDA device, not {device}")
        self._model, self._device, self._name = model, device, name
        self._additive = impl == "eager"
        self._cfg = model.config.get_text_config(decoder=True)
        self.max_rows, self._pad_id, self.graphs = max_rows, pad_id, graphs
        self.row_buckets = buckets(max_rows)
        self.rows = 0
        self.pos: list[int] = []  # each row's next position (its context length); 0: dead
        self._k: list[torch.Tensor] = []  # per layer [max_rows, heads, width, dim]
        self._v: list[torch.Tensor] = []
        self.width = 0
        self._ints = torch.zeros((2, max_rows), dtype=torch.long, device=device)  # ids, pos
        self._floats = torch.zeros((3, max_rows), dtype=torch.float32, device=device)  # u, T, p
        self._out = torch.zeros((2, max_rows), dtype=torch.float64, device=device)  # ids, lps
        pin = device.type == "cuda"
        self._ints_h = torch.zeros((2, max_rows), dtype=torch.long, pin_memory=pin)
        self._floats_h = torch.zeros((3, max_rows), dtype=torch.float32, pin_memory=pin)
        self._graphs: dict[tuple[int, int, bool, bool], Any] = {}
        self._pool: Any = None
        self.captures = 0  # CUDA graphs captured so far (recaptures after growth included)
        self.shapes: set[tuple[int, int, bool, bool]] = set()  # step shapes run so far

    # ------------------------------------------------------------------ row operations
    def free(self, rows: list[int]) -> None:
        for r in rows:
            self.pos[r] = 0

    def row_kv(self, row: int, n: int) -> list[tuple[Any, Any]]:
        """Per layer, copies of row `row`'s first `n` keys and values (`[heads, n, dim]`)."""
        return [(k[row, :, :n].clone(), v[row, :, :n].clone())
                for k, v in zip(self._k, self._v, strict=True)]

    def trim(self) -> None:
        """Nothing to trim: each row starts at column 0."""

    def compact(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.pos = 0, []
            return
        idx = torch.tensor(keep, device=self._device)
        for buf in (*self._k, *self._v):
            buf[:len(keep)] = buf.index_select(0, idx)  # index_select copies first
        self.pos = [self.pos[i] for i in keep]
        self.rows = len(keep)

    def fill(self, rows: list[int], cache: Any, lens: list[int], src: list[int]) -> None:
        """Rows `src` of a freshly prefilled, left-padded `cache` (real lengths `lens`) into
        rows `rows`, from column 0."""
        self._ensure(cache, max(lens))
        for k, v, layer in zip(self._k, self._v, cache.layers, strict=True):
            n = layer.keys.shape[2]
            for r, i, ln in zip(rows, src, lens, strict=True):
                k[r, :, :ln] = layer.keys[i, :, n - ln:]
                v[r, :, :ln] = layer.values[i, :, n - ln:]
        for r, ln in zip(rows, lens, strict=True):
            self.pos[r] = ln

    def append(self, cache: Any, mask: Any, pos: Any) -> None:
        """Freshly prefilled rows after the existing ones (`pos`: their lengths)."""
        lens = [int(x) for x in pos.tolist()]
        new = list(range(self.rows, self.rows + len(lens)))
        if new[-1] >= self.max_rows:
            raise EngineError(f"{self._name}: {new[-1] + 1} rows, over max_running "
                              f"{self.max_rows}")
        self.rows += len(lens)
        self.pos.extend([0] * len(lens))
        self.fill(new, cache, lens, list(range(len(lens))))

    def _ensure(self, cache: Any, length: int) -> None:
        """Buffers shaped after `cache`'s layers (the first prefill), wider than `length`."""
        if not self._k:
            self.width = _wide_enough(length + 1, MIN_WIDTH)
            shape = (self.max_rows, 0, self.width, 0)
            self._k = [layer.keys.new_zeros(_like(shape, layer.keys)) for layer in cache.layers]
            self._v = [layer.values.new_zeros(_like(shape, layer.values))
                       for layer in cache.layers]
        elif length >= self.width:
            self._grow(length + 1)

    def _grow(self, need: int) -> None:
        """Wider buffers (a copy) holding `need` columns; every captured graph read the old
        ones, so all are dropped."""
        width = _wide_enough(need, self.width)
        for bufs in (self._k, self._v):
            for i, old in enumerate(bufs):
                new = old.new_zeros(_like((self.max_rows, 0, width, 0), old))
                new[:, :, :self.width] = old
                bufs[i] = new
        self.width = width
        self._graphs.clear()

    # ---------------------------------------------------------------------------- step
    def decode(self, rows: list[int], tokens: list[int], temperatures: list[float],
               top_ps: list[float], generators: list[Any], default: torch.Generator
               ) -> tuple[list[int], list[float]]:
        """One decode step: row `rows[i]` is fed `tokens[i]` and sampled with
        `temperatures[i]`, `top_ps[i]`, `generators[i]` (as `sampling.sample_rows`); every
        other row is dead. Returns each of `rows`' token and log-prob."""
        need = max(self.pos[r] for r in rows) + 1
        if need > self.width:
            self._grow(need)
        b = bucket(self.rows, self.row_buckets)
        w = bucket(need, buckets(self.width, MIN_WIDTH))
        ints, floats = self._ints_h, self._floats_h
        ints[0, :b] = self._pad_id
        ints[1, :b] = 0
        floats[:, :b] = 0.0
        floats[2, :b] = 1.0
        idx = torch.tensor(rows)
        ints[0, idx] = torch.tensor(tokens)
        ints[1, idx] = torch.tensor([self.pos[r] for r in rows])
        floats[1, idx] = torch.tensor(temperatures, dtype=torch.float32)
        floats[2, idx] = torch.tensor(top_ps, dtype=torch.float32)
        sampled = [i for i, t in enumerate(temperatures) if t != 0]
        top_p = any(top_ps[i] < 1.0 for i in sampled)
        scaled = any(temperatures[i] != 1.0 for i in sampled)
        if sampled:  # the same draws, in the same order, as `sample_rows`
            s = torch.tensor([rows[i] for i in sampled])
            floats[0, s] = _uniforms([generators[i] for i in sampled], default)
        self._ints[:, :b].copy_(ints[:, :b], non_blocking=True)
        self._floats[:, :b].copy_(floats[:, :b], non_blocking=True)
        key = (b, w, top_p, scaled)
        self.shapes.add(key)
        if self.graphs:
            self._replay(key)
        else:
            self._step(key)
        host = self._out[:, idx.to(self._device)].cpu()
        for r in rows:
            self.pos[r] += 1
        return [int(t) for t in host[0].tolist()], host[1].tolist()

    def _step(self, key: tuple[int, int, bool, bool]) -> None:
        """The fixed-shape step for `key = (rows, width, top_p, scaled)`, from the input
        buffers to the output buffer; nothing in it reads back to the host."""
        b, w, top_p, scaled = key
        ids, pos = self._ints[0, :b], self._ints[1, :b]
        cache = DynamicCache(config=self._cfg)
        cache.layers = []
        for k, v in zip(self._k, self._v, strict=True):
            layer = _RowLayer()
            layer.keys, layer.values = k[:b, :, :w], v[:b, :, :w]
            layer.index = pos.view(b, 1, 1, 1).expand(b, k.shape[1], 1, k.shape[3])
            layer.is_initialized = True
            cache.layers.append(layer)
        cols = torch.arange(w, device=self._device)
        mask = (cols.unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, w)
        if self._additive:
            dtype = self._k[0].dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=self._device).masked_fill_(
                ~mask, torch.finfo(dtype).min)
        out = self._model(input_ids=ids.unsqueeze(1), attention_mask=mask,
                          position_ids=pos.unsqueeze(1), past_key_values=cache, use_cache=True)
        toks, lps = sample_fixed(out.logits[:, -1, :], self._floats[1, :b],
                                 self._floats[2, :b], self._floats[0, :b], top_p, scaled)
        self._out[0, :b].copy_(toks)
        self._out[1, :b].copy_(lps)

    def _replay(self, key: tuple[int, int, bool, bool]) -> None:
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key)
        g.replay()

    def _capture(self, key: tuple[int, int, bool, bool]) -> Any:
        """Warm up, capture and keep the step for `key`, on the current inputs (see the module
        docstring: running it again writes the same keys and values)."""
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._step(key)
        torch.cuda.current_stream(self._device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread_local: the trainer may use the same GPU from another thread meanwhile
        with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            self._step(key)
        self._graphs[key] = g
        self.captures += 1
        return g


def _wide_enough(need: int, width: int) -> int:
    """`width` doubled until it holds `need` columns."""
    while width < need:
        width *= 2
    return width


def _like(shape: tuple[int, int, int, int], t: torch.Tensor) -> tuple[int, int, int, int]:
    """`shape`'s rows and width with `t`'s heads and head dim."""
    return (shape[0], t.shape[1], shape[2], t.shape[3])


def sample_fixed(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor,
                 u: torch.Tensor, top_p: bool, scaled: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample_rows` with every shape fixed and nothing read back to the host.

    Per row: `temps` 0 is greedy, `u` the row's uniform draw (ignored when greedy). `top_p`
    says whether some sampled row has top-p < 1: then every sampled row samples in sorted
    order over its nucleus, as `sample_rows` does for such a batch. `scaled` False: every
    sampled row has temperature 1, and the pass dividing by it is left out, as `sample_rows`
    leaves it out (dividing by 1 is exact either way). Returns the token ids and
    log-probs as float64 `[B]` tensors on the logits' device. The arithmetic is
    `sample_rows`' step for step (dividing by a temperature of 1 is exact), so the same logits
    and uniforms give the same tokens and log-probs."""
    vocab = logits.shape[1]
    greedy = temps == 0
    x = logits.float()
    if scaled:
        x = x / torch.where(greedy, 1.0, temps).unsqueeze(1)
    top, toks = x.max(dim=-1, keepdim=True)
    e = (x - top).exp_()
    size = max(1, math.isqrt(vocab))
    block_cdf = _block_sums(e, size).cumsum_(dim=-1)
    total = block_cdf[:, -1:]
    if top_p:
        picked = _sample_top_p(e / total, top_ps, u)
    else:
        picked = _pick_blocked(e, block_cdf, size, u)
    toks = torch.where(greedy.unsqueeze(1), toks, picked.unsqueeze(1))
    lps = (x.gather(1, toks) - top - total.log()).squeeze(1)
    lps = torch.where(torch.isfinite(lps), lps, NEG_LOGPROB)
    return toks.squeeze(1).to(torch.float64), lps.to(torch.float64)


def _pick_blocked(e: torch.Tensor, block_cdf: torch.Tensor, size: int,
                  u: torch.Tensor) -> torch.Tensor:
    """`sampling._pick_blocked` with a masked fill where it assigns through a boolean index
    (which reads the mask back to the host on CUDA): the same values."""
    block = _pick(block_cdf, u)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1))
                         .squeeze(1), 0.0)
    start = block * size
    want = start.unsqueeze(1) + torch.arange(size, device=e.device)
    cols = want.clamp(max=e.shape[1] - 1)
    inside = e.gather(1, cols).masked_fill_(cols < want, 0.0)  # past V
    cdf = inside.cumsum_(dim=-1)
    share = ((u * block_cdf[:, -1] - before) / cdf[:, -1]).clamp_(0.0, 1.0)
    return start + _pick(cdf, share)
