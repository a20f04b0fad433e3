"""The `local` engine: an in-process torch engine with continuous batching over an HF causal LM.

Owns: admission of requests into one running batch under a fixed KV token budget, which row of
the batched left-padded KV cache each request holds (decided by `plan.Planner`, pure
bookkeeping without torch; the cache's row operations are `batch.BatchCache`), per-request
sampling (greedy, temperature, top-p, seeds), stop rules (token ids, strings, `max_new_tokens`), streaming each
request's tokens to its consumer, preemption when the running batch would outgrow the budget,
and in-process weight updates with a version number. Does not own: which requests arrive or
when (the scheduler), tokenization (the caller sends ids), or training.

Lifecycle: `async with LocalEngine(...) as engine:` (or `await engine.start()` ...
`await engine.close()`). `start` creates the step driver, a task the engine owns and `close`
awaits; requests still open at `close` end with finish reason "abort".

How a step runs. The event loop plans a step (rows whose request left become dead rows, preempt
if needed, admit waiting requests), then one worker thread runs it: one decode forward over the
batch (one token for each running row; a dead row is fed a dummy token and attends only to its
own dummies, so its output is finite and discarded) and one prefill forward for the rows
admitted this step (left-padded, batched). The admitted move into dead rows first: their keys
and values are written into the batch cache, right-aligned with it, and only those that find no
dead row are appended (a copy of the cache). Dead rows are dropped (a copy) when they would
outnumber the live ones, or when an eighth of the rows have stayed dead for a few steps with
nothing waiting (a draining batch), so in steady churn rows leave and join without moving the
cache. The model forward never runs on the event loop. The cache's layers are
`kvcache.GrowingLayer`s: a decode step writes its column in place instead of concatenating the
whole cache; trimming leading padding, and taking trimmed columns back when a longer request
moves in, are views. Requests admitted together with the same context (a GRPO group's samples)
are prefilled once and their cache rows copied. Sampling is one batched pass on the model's
device (`sampling.sample_rows`); only the step's token ids and log-probs cross to the host.
Weight updates take the same lock as a step, so they land between steps, never during a
forward. With `decode="static"` the batch is a `static.StaticBatch` instead: the same plan and
row operations over a preallocated per-row cache, and a fixed-shape decode step with the
sampling inside it (captured as CUDA graphs on CUDA); prefill is the same. After
`RELEASE_IDLE_S` with no request (a wave or an evaluation over, not a tool call's pause) the
dead rows' cache is dropped (the eager batch's; a static one is preallocated and stays) and
the C heap trimmed (`asyncrl.allocator`), as after each weight update: the KV cache of a full
batch is the engine's largest allocation.

KV budget. `kv_token_budget` counts tokens held by running requests: input + generated so far
(padding columns of the batched cache are not counted). The engine never lets the held total
exceed it: a request is admitted only when its context, its first token and a small growth
reserve fit; if the next decode step would not fit, the most recently admitted request is
preempted (its cache rows dropped, it goes back to the head of the queue and is re-prefilled
from input + generated later; its stream just pauses). A request that could never fit alone
(`len(input_ids) + max_new_tokens > kv_token_budget`) is refused with `EngineError`.
`load()` reports the held total, the budget, running and waiting counts; `peak_kv_tokens` the
highest held total seen.

Numerics: fp32 greedy output equals `model.generate(do_sample=False)` for the same prompt
alone or batched with others, up to float ties (padding changes summation order only).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asyncrl import allocator
from asyncrl.engine.base import (
    EngineLoad,
    GenerateRequest,
    TokenDelta,
    WeightUpdate,
)
from asyncrl.engine.local import attention
from asyncrl.engine.local.batch import BatchCache
from asyncrl.engine.local.plan import DONE, RUNNING, Plan, Planner, Seq
from asyncrl.engine.local.prefix import PrefixStore, prefill_continuations
from asyncrl.engine.local.sampling import sample_rows
from asyncrl.engine.local.weights import load_base
from asyncrl.errors import EngineError, EngineUnavailable, WeightSyncError
from asyncrl.log import get_logger

log = get_logger(__name__)

DECODES = ("eager", "static")
"""`decode`'s choices (the `[engine] decode` config key)."""

PREFIX_MAX_AGE_S = 120.0
"""An idle engine's release drops continuation-cache entries older than this (their rollouts
ended, or were dropped, without continuing)."""

RELEASE_IDLE_S = 1.0
"""Seconds with no request before an idle engine drops its dead rows and trims the heap
(`_release`): the end of a wave or an evaluation, not the pause of a tool call."""

@dataclass
class _Out:
    seq: Seq
    token: int
    logprob: float
    finish: str | None
    routes: Any = None
    """With routing recorded: the experts of the tokens this step fed for `seq`."""
    restart: bool = False
    """`routes` is a prefill's: the whole context, replacing the record so far."""


class LocalEngine:
    """In-process continuous-batching engine over an HF causal LM (see the module docstring).

    `LocalEngine(model, tokenizer, *, kv_token_budget, max_running, name="local-0",
    device="cpu", threads=0, admit_reserve=16, seed=0)`. `model` is used as given (moved to
    `device`, put in eval mode): pass a copy if a trainer keeps training the original.
    `threads > 0` sets torch's intra-op thread count (process-wide) from the worker thread.
    `admit_reserve`: growth tokens a request must have room for beyond its first token to be
    admitted (fewer preemptions right after admission). `packed`: on a CPU, run the fp32
    linear layers on oneDNN with pre-packed weights (`packed.pack_linears`).
    `record_routing`: an MoE model's expert choices go with each request's last delta
    (`TokenDelta.routed_experts`, `routing.RouterTap`); a dense model is refused.
    `decode`: "eager" (the left-padded growing cache above) or "static" (`static.StaticBatch`:
    a preallocated per-row cache and a fixed-shape decode step with sampling on the device,
    captured as CUDA graphs on a CUDA device unless `cuda_graphs` is False; prefill stays
    eager; routing records are refused).
    `prefix_cache_tokens`: keep up to this many tokens of KV from requests that finished with
    "stop" (`prefix.PrefixStore`), so a continuation (a tool call's next turn) prefills only
    what is new; 0 keeps none. Refused with routing records (a continuation's prefill would
    route only its new tokens).
    """

    def __init__(self, model: Any, tokenizer: Any, *, kv_token_budget: int, max_running: int,
                 name: str = "local-0", device: str = "cpu", threads: int = 0,
                 admit_reserve: int = 16, seed: int = 0, packed: bool = True,
                 record_routing: bool = False, decode: str = "eager",
                 cuda_graphs: bool = True, prefix_cache_tokens: int = 0) -> None:
        import torch

        from asyncrl.engine.local.kvcache import growing_cache
        from asyncrl.engine.local.packed import pack_linears

        if kv_token_budget < 2 or max_running < 1:
            raise ValueError("kv_token_budget must be >= 2 and max_running >= 1")
        if decode not in DECODES:
            raise EngineError(f"{name}: decode {decode!r} is not one of {list(DECODES)}")
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if prefix_cache_tokens and record_routing:
            raise EngineError(f"{name}: the continuation cache does not record MoE routing "
                              "(a continuation prefills only its new tokens); set "
                              "prefix_cache_tokens = 0 for routing replay")
        if decode == "static" and record_routing:
            raise EngineError(f"{name}: the static decode does not record MoE routing; use "
                              "decode = \"eager\" for routing replay")
        self.name = name
        self.policy_version = 0
        self.kv_token_budget = kv_token_budget
        self.max_running = max_running
        self.peak_kv_tokens = 0
        self.steps = 0
        self.prefills_shared = 0  # admitted requests whose context another one prefilled
        self._torch = torch
        self._new_cache = growing_cache
        self._device = torch.device(device)
        self._model = model.to(self._device).eval()
        attention.install(self._model)  # one-token GQA steps without repeat_kv
        self._packed = pack_linears(self._model, self._device) if packed else None
        self._tap: Any = None
        if record_routing:
            from asyncrl.engine.local.routing import RouterTap

            self._tap = RouterTap(torch, self._model, name)
        self._merger: Any = None  # engine.adapter.AdapterMerger, made at the first update
        self.prefix: PrefixStore | None = (PrefixStore(prefix_cache_tokens)
                                           if prefix_cache_tokens else None)
        """The continuation cache (worker thread only); None when off."""
        self._tokenizer = tokenizer
        self._threads = threads
        self._pad_id = int(tokenizer.pad_token_id or 0)
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-fwd")
        self._seqs: dict[str, Seq] = {}
        self._planner = Planner(kv_token_budget=kv_token_budget, max_running=max_running,
                                admit_reserve=admit_reserve, name=name)
        self._decode, self._cuda_graphs = decode, cuda_graphs
        self._batch = self._new_batch()
        self._work = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._driver: asyncio.Task[None] | None = None
        self._closing = False
        self._release_due = False
        """Steps ran since the heap was last trimmed (`asyncrl.allocator`: when idle)."""
        self._check_layers()

    # ------------------------------------------------------------------------ lifecycle
    async def start(self) -> LocalEngine:
        """Start the step driver (idempotent). Requires a running event loop."""
        if self._driver is None:
            if self._threads > 0:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._torch.set_num_threads, self._threads)
            self._closing = False
            self._driver = asyncio.create_task(self._drive(), name=f"{self.name}-driver")
        return self

    async def close(self) -> None:
        """Stop after the step in flight; open requests end with finish reason "abort"."""
        self._closing = True
        self._work.set()
        if self._driver is not None:
            try:
                await asyncio.shield(self._driver)
            finally:
                self._driver = None
        for seq in list(self._seqs.values()):
            self._finish(seq, TokenDelta(token_ids=[], logprobs=[], finish_reason="abort",
                                         policy_version=self.policy_version))
        self._planner.rows = []
        self._batch = self._new_batch()
        self._executor.shutdown(wait=True)
        if self.prefix is not None:
            log.info("engine_prefix_cache", engine=self.name, **self.prefix.stats())
            self.prefix.clear()

    async def __aenter__(self) -> LocalEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------------------- protocol
    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Token deltas for `request` (one token each); see `base` for the contract.

        Leaving the iteration early (break, cancellation) aborts the request.
        """
        seq = self._submit(request)
        del request  # `seq` has its own copy of the ids
        if seq is None:  # max_new_tokens == 0
            yield TokenDelta(token_ids=[], logprobs=[], finish_reason="length",
                             policy_version=self.policy_version)
            return
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    yield item
                    return
                yield item
                item = None  # not kept alive while waiting (young GC would traverse it)
        finally:
            if seq.state != DONE:
                self._abort_seq(seq)

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._abort_seq(seq)

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (a request preempted twice counts twice)."""
        return self._planner.preemptions

    async def load(self) -> EngineLoad:
        pl = self._planner
        return EngineLoad(kv_tokens_used=pl.held, kv_tokens_capacity=self.kv_token_budget,
                          running=pl.running, waiting=len(pl.waiting))

    async def update_weights(self, update: WeightUpdate) -> None:
        """Copy new weights into the model between steps, then bump `policy_version`.

        `update.state_dict` (tensors, copied, never aliased) or `update.path` (a directory of
        HF safetensors); and/or a LoRA adapter (`update.adapter` or `update.adapter_path`),
        merged into the weights over the base (`engine.adapter.AdapterMerger`). Running
        requests keep their KV cache; tokens produced after the update carry the new version.
        Raises `WeightSyncError` on unknown parameter names, or an adapter over a base this
        engine does not hold.
        """
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            await loop.run_in_executor(self._executor, self._load_weights, update)
            self.policy_version = update.version
        log.info("engine_weights_updated", engine=self.name, version=update.version)

    async def release(self) -> bool:
        """Drop the batch's cache and trim the heap now, as an idle second would, if nothing is
        running or waiting; True if it did. A synchronous run calls it before the trainer's
        step, so the rollouts' KV cache does not live into the step's first second."""
        loop = asyncio.get_running_loop()
        async with self._step_lock:
            if not self._planner.idle or self._closing:
                return False
            self._release_due = False
            if self._decode == "eager":  # a static batch keeps its rows
                self._planner.rows = []
            await loop.run_in_executor(self._executor, self._release)
        return True

    # ------------------------------------------------------------------ loop-side state
    def _submit(self, request: GenerateRequest) -> Seq | None:
        if self._driver is None or self._closing:
            raise EngineUnavailable(f"{self.name}: engine is not running (use `async with`)")
        sp = request.sampling
        if request.request_id in self._seqs:
            raise EngineError(f"{self.name}: duplicate request id {request.request_id!r}")
        if not request.input_ids:
            raise EngineError(f"{self.name}: empty input_ids")
        if sp.max_new_tokens < 0 or sp.temperature < 0 or not 0 < sp.top_p <= 1:
            raise EngineError(f"{self.name}: bad sampling params {sp}")
        if sp.max_new_tokens == 0:
            return None
        need = len(request.input_ids) + sp.max_new_tokens
        if need > self.kv_token_budget:
            raise EngineError(f"{self.name}: request needs {need} KV tokens, more than the "
                              f"engine's budget of {self.kv_token_budget}")
        gen = None
        if sp.seed is not None and sp.temperature > 0:
            gen = self._torch.Generator(device="cpu").manual_seed(sp.seed)
        seq = Seq(request, asyncio.Queue(), gen)
        self._seqs[seq.rid] = seq
        self._planner.waiting.append(seq)
        self._work.set()
        return seq

    def _finish(self, seq: Seq, final: TokenDelta | BaseException) -> None:
        self._planner.leave(seq)
        self._seqs.pop(seq.rid, None)
        seq.queue.put_nowait(final)

    def _abort_seq(self, seq: Seq) -> None:
        if seq.state != DONE:
            self._finish(seq, TokenDelta(token_ids=[], logprobs=[], finish_reason="abort",
                                         policy_version=self.policy_version))

    def _apply(self, plan: Plan, outs: list[_Out]) -> None:
        # Finished requests first: their consumers (often a tool call about to fire) wake
        # before the rest of the batch's deltas are handed out.
        outs.sort(key=lambda o: o.finish is None)
        for o in outs:
            seq = o.seq
            if seq.state != RUNNING:  # aborted while the step ran
                continue
            seq.generated.append(o.token)
            self._planner.held += 1
            delta = TokenDelta(token_ids=[o.token], logprobs=[o.logprob], finish_reason=o.finish,
                               policy_version=plan.version)
            if o.routes is not None:
                if o.restart:
                    seq.routes = [o.routes]
                else:
                    seq.routes.append(o.routes)
                if o.finish is not None:
                    delta.routed_experts = self._tap.encode(seq.routes)
            if o.finish is not None:
                self._finish(seq, delta)
            else:
                seq.queue.put_nowait(delta)
        self.peak_kv_tokens = max(self.peak_kv_tokens, self._planner.held)
        assert self._planner.held <= self.kv_token_budget, "KV budget invariant broken"

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if self._planner.idle:
                self._work.clear()
                if self._release_due:
                    try:  # idle for a while (not a tool call's pause): drop the dead rows
                        await asyncio.wait_for(self._work.wait(), RELEASE_IDLE_S)
                    except TimeoutError:
                        await self.release()
                    continue
                await self._work.wait()
                continue
            async with self._step_lock:
                if self._closing:
                    break
                plan = self._planner.plan(self.policy_version)
                if not plan.decode and not plan.prefill:
                    continue
                try:
                    outs = await loop.run_in_executor(self._executor, self._step, plan)
                except Exception as e:  # a failed forward leaves the batch cache unusable
                    log.error("engine_step_failed", engine=self.name, error=repr(e))
                    err = EngineError(f"{self.name}: forward failed: {e!r}")
                    for seq in [plan.rows[i] for i in plan.decode] + plan.prefill:
                        if seq is not None and seq.state != DONE:
                            self._finish(seq, err)
                    self._planner.rows = []
                    self._batch = self._new_batch()
                    continue
                self.steps += 1
                self._release_due = True
                self._apply(plan, outs)

    # ----------------------------------------------------------------- worker thread
    def _new_batch(self) -> Any:
        if self._decode == "eager":
            return BatchCache()
        from asyncrl.engine.local.static import StaticBatch

        return StaticBatch(self._model, self._device, max_rows=self.max_running,
                           pad_id=self._pad_id, name=self.name,
                           graphs=self._cuda_graphs and self._device.type == "cuda")

    def _release(self) -> None:
        """The batch's cache (only dead rows are left) goes, and the heap's free pages with it
        (`asyncrl.allocator`)."""
        if self._decode == "eager":  # a static batch's cache is preallocated: it stays
            self._batch = BatchCache()
        if self.prefix is not None:
            self.prefix.expire(PREFIX_MAX_AGE_S)
            log.info("engine_prefix_cache", engine=self.name, **self.prefix.stats())
        allocator.release()

    def _check_layers(self) -> None:
        cfg = self._model.config.get_text_config(decoder=True)
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            raise EngineError(f"{self.name}: only full-attention models are supported "
                              f"(layer types {sorted(types)})")

    def _step(self, plan: Plan) -> list[_Out]:
        torch = self._torch
        outs: list[_Out] = []
        with torch.inference_mode():
            b = self._batch
            if plan.compact is not None:
                b.compact(plan.compact)
            if plan.freed:
                b.free(plan.freed)
            b.trim()
            if plan.decode and self._decode == "static":
                seqs = [plan.rows[i] for i in plan.decode]
                toks, lps = b.decode(plan.decode, [s.generated[-1] for s in seqs],  # type: ignore[union-attr]
                                     *self._sampling(seqs), self._generator)  # type: ignore[arg-type]
                decoded = self._outs(seqs, toks, lps)  # type: ignore[arg-type]
                self._keep_stopped(decoded, plan.decode)
                outs.extend(decoded)
            elif plan.decode:
                last = torch.full((b.rows, 1), self._pad_id, dtype=torch.long)
                seqs = [plan.rows[i] for i in plan.decode]
                rows = torch.tensor(plan.decode)
                last[rows, 0] = torch.tensor([s.generated[-1] for s in seqs])  # type: ignore[union-attr]
                live = torch.zeros(b.rows, dtype=torch.long)
                live[rows] = 1
                b.begin_decode()
                out = self._model(input_ids=last.to(self._device), attention_mask=b.mask,
                                  position_ids=b.pos.unsqueeze(1), past_key_values=b.cache,
                                  use_cache=True)
                b.pos = b.pos + live.to(self._device)
                logits = out.logits[:, -1, :]
                if len(seqs) < b.rows:
                    logits = logits.index_select(0, rows.to(self._device))
                decoded = self._sample(logits, seqs)  # type: ignore[arg-type]
                self._keep_stopped(decoded, plan.decode)
                if self._tap is not None:  # one routed token per row: the one each row fed
                    routed = self._tap.take()
                    for o, row in zip(decoded, plan.decode, strict=True):
                        o.routes = routed[row:row + 1]
                outs.extend(decoded)
            if plan.prefill:
                outs.extend(self._prefill(plan.prefill, plan.fill, plan.version))
        return outs

    def _prefill(self, seqs: list[Seq], fill: list[int], version: int) -> list[_Out]:
        """Prefill `seqs` together, write the first `len(fill)` into those dead rows, append
        the rest as new rows.

        Identical contexts (a GRPO group's samples arrive together with one prompt) are
        computed once: the forward runs on the distinct contexts, and each request gets a copy
        of its context's cache row and last logits (then samples on its own). A context that
        continues a kept one (`prefix.PrefixStore`) computes only its new tokens
        (`prefix.prefill_continuations`)."""
        torch = self._torch
        ctxs = [s.input_ids + s.generated for s in seqs]
        first: dict[tuple[int, ...], int] = {}
        unique: list[list[int]] = []
        owner = []  # row of the prefill that computes request i's context
        for c in ctxs:
            key = tuple(c)
            if key not in first:
                first[key] = len(unique)
                unique.append(c)
            owner.append(first[key])
        self.prefills_shared += len(seqs) - len(unique)
        width = max(len(c) for c in unique)
        hits = ([self.prefix.take(c, version) for c in unique] if self.prefix is not None
                else [])
        if any(hits):
            cache, mask, logits = prefill_continuations(
                self._model, self._new_cache(self._model.config), self._pad_id, unique, hits)
        else:
            ids = torch.full((len(unique), width), self._pad_id, dtype=torch.long)
            mask = torch.zeros((len(unique), width), dtype=torch.long)
            for i, c in enumerate(unique):
                ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
                mask[i, width - len(c):] = 1
            ids, mask = ids.to(self._device), mask.to(self._device)
            pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
            cache = self._new_cache(self._model.config)
            out = self._model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        if len(unique) < len(seqs):
            logits = logits.index_select(0, torch.tensor(owner, device=self._device))
        lens = [len(c) for c in ctxs]
        n = len(fill)
        if fill:
            self._batch.fill(fill, cache, lens[:n], owner[:n])
        if n < len(seqs):
            if owner[n:] != list(range(len(unique))):  # some rows were filled in or shared
                rows = torch.tensor(owner[n:], device=self._device)
                for layer in cache.layers:
                    layer.keys = layer.keys.index_select(0, rows)
                    layer.values = layer.values.index_select(0, rows)
                mask = mask.index_select(0, rows)
            self._batch.append(cache, mask, torch.tensor(lens[n:], device=self._device))
        outs = self._sample(logits, seqs)
        if self._tap is not None:  # each context's rows, its left padding dropped
            routed = self._tap.take().view(len(unique), width, self._tap.layers, -1)
            for o, u, n_ctx in zip(outs, owner, lens, strict=True):
                o.routes, o.restart = routed[u, width - n_ctx:], True
        return outs

    def _keep_stopped(self, outs: list[_Out], rows: list[int]) -> None:
        """Requests that stopped this step leave a copy of their cache row (every token fed so
        far) in the continuation cache, before the row is freed (`prefix.PrefixStore`)."""
        if self.prefix is None:
            return
        for o, row in zip(outs, rows, strict=True):
            if o.finish == "stop":
                seq = o.seq
                n = len(seq.input_ids) + len(seq.generated)
                if self.prefix.keeps(n):
                    self.prefix.put(seq.input_ids + seq.generated, self._batch.row_kv(row, n),
                                    self.policy_version)

    def _sample(self, logits: Any, seqs: list[Seq]) -> list[_Out]:
        toks, lps = sample_rows(logits, *self._sampling(seqs), self._generator)
        return self._outs(seqs, toks, lps)

    @staticmethod
    def _sampling(seqs: list[Seq]) -> tuple[list[float], list[float], list[Any]]:
        return ([s.sampling.temperature for s in seqs], [s.sampling.top_p for s in seqs],
                [s.generator for s in seqs])

    def _outs(self, seqs: list[Seq], toks: list[int], lps: list[float]) -> list[_Out]:
        return [_Out(s, tok, lp, self._finish_reason(s, tok))
                for s, tok, lp in zip(seqs, toks, lps, strict=True)]

    def _finish_reason(self, seq: Seq, tok: int) -> str | None:
        sp = seq.sampling
        if tok in sp.stop_token_ids:
            return "stop"
        if sp.stop_strings and self._stop_string_hit(seq, tok):
            return "stop"
        if len(seq.generated) + 1 >= sp.max_new_tokens:
            return "length"
        return None

    def _stop_string_hit(self, seq: Seq, tok: int) -> bool:
        """True when a stop string ends inside the text of the newest token."""
        longest = max(len(s) for s in seq.sampling.stop_strings)
        tail = [*seq.generated[-(longest + 2):], tok]
        before = self._tokenizer.decode(tail[:-1])
        text = self._tokenizer.decode(tail)
        for s in seq.sampling.stop_strings:
            if text.find(s, max(0, len(before) - len(s) + 1)) >= 0:
                return True
        return False

    def _load_weights(self, update: WeightUpdate) -> None:
        if self.prefix is not None:  # kept keys and values are the old weights'
            self.prefix.clear()
        try:
            self._change_weights(update)
        finally:  # the packed copies follow the weights, even those of a half-done load
            if self._packed is not None:
                self._packed.repack()
            allocator.release()  # the old packed copies, a loaded checkpoint's tensors

    def _change_weights(self, update: WeightUpdate) -> None:
        from asyncrl.engine.local.lora_merge import AdapterMerger, read_adapter_dir

        if not (update.has_base or update.has_adapter):
            raise WeightSyncError(f"{self.name}: weight update has neither tensors nor a path")
        if self._merger is None:
            self._merger = AdapterMerger(self._model, self.name)
        if update.has_base:
            self._merger.new_base(None)  # a load that fails half-way leaves no known base
            load_base(self._model, update, self.name)
            self._merger.new_base(update.version)
        if update.has_adapter:
            factors: Any = update.adapter
            if factors is None:
                factors = read_adapter_dir(update.adapter_path)
            base = update.version if update.has_base else update.base_version
            self._merger.apply(factors, base)
