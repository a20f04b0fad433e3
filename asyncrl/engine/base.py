"""The engine protocol: the only thing the rest of asyncrl knows about inference.

Owns: the request/delta/load shapes, the `Engine` protocol and `push_to_all` (one update to
several engines at once, each failure returned by name). Does not own: any engine (see
the `local`, `remote`, `sglang` and `vllm` packages) or the choice between them (`registry.py`).

An engine streams token deltas for a request (`stream`, an async iterator), aborts a request,
reports its load (KV tokens in use and capacity, running and waiting requests), and accepts new
weights. "Generate whole" is `collect`, a thin helper over the stream.

Contract of `stream`:
- `request.input_ids` is the whole context (prompt + every earlier turn); the engine may reuse
  its prefix cache. The stream yields `TokenDelta`s whose `token_ids`/`logprobs` are parallel;
  the last delta has `finish_reason` set ("stop" = a stop token/string matched, "length" =
  `max_new_tokens` reached, "abort" = aborted). Stop tokens/strings are *included* in the
  output (the agent loop needs the closing tag's tokens).
- `logprobs` are the sampling logprobs (log-softmax of the temperature-scaled, unfiltered
  logits) of the emitted tokens.
- Failures raise `EngineError` (or `EngineUnavailable` when the engine is down), never hang:
  every remote call has a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from asyncrl.errors import WeightSyncError
from asyncrl.records import RoutedExperts


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    """Stop after emitting any of these ids (the id is part of the output)."""
    stop_strings: tuple[str, ...] = ()
    """Stop once the decoded output of this request ends with any of these strings."""
    seed: int | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams


class TokenDelta(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None while streaming; "stop", "length" or "abort" on the last delta."""
    policy_version: int = 0
    """Version of the weights that produced these tokens."""
    routed_experts: RoutedExperts | None = None
    """On the last delta, from an engine built to record routing (routing replay,
    `algorithm.routing_replay`): the experts chosen for `input_ids` and every output token
    but the last (`records.RoutedExperts`). None from an engine that records nothing."""


class EngineLoad(msgspec.Struct, kw_only=True):
    kv_tokens_used: int
    kv_tokens_capacity: int
    running: int
    waiting: int
    age_s: float = 0.0
    """How old these numbers were when returned (the server's own refresh lag plus any
    caching): admission trusts an old report less."""

    @property
    def kv_free(self) -> int:
        return max(0, self.kv_tokens_capacity - self.kv_tokens_used)


class WeightUpdate(msgspec.Struct, kw_only=True):
    """New weights for an engine: a directory of HF safetensors, or in-process tensors; and/or
    a LoRA adapter over them (`adapter`, `adapter_path`)."""

    version: int
    path: str = ""
    """Directory with HF-format weights (disk sync)."""
    state_dict: object | None = None
    """In-process `dict[str, torch.Tensor]` (local engine / colocated sync); not serialised."""
    adapter: object | None = None
    """In-process LoRA adapter over the base weights: `{module}.lora_A` [r, in] and
    `{module}.lora_B` [out, r] (the `alpha / r` scaling folded in) by HF module name; the
    engine serves `W_base + B @ A` for each. With `path`/`state_dict` set too, those are the
    new base and the adapter applies over it; alone, it applies over the base of
    `base_version`, and an engine holding another base refuses it."""
    adapter_path: str = ""
    """A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`):
    the disk form of `adapter`."""
    base_version: int = 0
    """For an adapter: the version of the update that carried its base weights."""

    @property
    def has_adapter(self) -> bool:
        return self.adapter is not None or bool(self.adapter_path)

    @property
    def has_base(self) -> bool:
        return self.state_dict is not None or bool(self.path)


@runtime_checkable
class Engine(Protocol):
    """What every inference engine provides. See the module docstring for the contract."""

    name: str
    policy_version: int

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def load(self) -> EngineLoad: ...

    async def update_weights(self, update: WeightUpdate) -> None: ...

    async def close(self) -> None: ...


class Generation(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


async def collect(engine: Engine, request: GenerateRequest) -> Generation:
    """Run a request to the end and return everything it produced."""
    ids: list[int] = []
    lps: list[float] = []
    reason = "abort"
    async for d in engine.stream(request):
        ids.extend(d.token_ids)
        lps.extend(d.logprobs)
        if d.finish_reason is not None:
            reason = d.finish_reason
    return Generation(token_ids=ids, logprobs=lps, finish_reason=reason)


async def push_to_all(engines: Sequence[Engine], update: WeightUpdate
                      ) -> list[tuple[str, WeightSyncError]]:
    """`update` to every engine at once; (name, error) of each engine whose update failed.

    Waits for every engine; then an error that is not a `WeightSyncError` (a bug, a
    cancellation) is raised, the first in `engines` order.
    """
    results = await asyncio.gather(*(e.update_weights(update) for e in engines),
                                   return_exceptions=True)
    failed = [(e.name, r) for e, r in zip(engines, results, strict=True)
              if isinstance(r, BaseException)]
    for _, r in failed:
        if not isinstance(r, WeightSyncError):
            raise r
    return [(n, r) for n, r in failed if isinstance(r, WeightSyncError)]
