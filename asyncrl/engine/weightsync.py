"""Pushing one weight version into engines: the side of a weight update that is not a server's.

Owns: fanning an update out to several engines (`push_to_all`: concurrently; one engine's
`WeightSyncError` does not stop the others, and the failures are returned by name, since a
failed engine keeps serving its old weights under its old version tags), and running the
trainer's part of a collective sync alongside the server's call (`with_peer`: both sides block
until every rank arrives, so they run together; the first failure ends both).

Does not own: the update sequence of one server (pause, apply, flush, version, resume:
`remote.RemoteEngine`), any server's weight endpoints (`sglang_weights`, `vllm`), or the
trainer's state dict, export and collectives (the train loop passes them in as an update or
as the `peer` callable).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncrl.engine.base import WeightUpdate
from asyncrl.errors import EngineError, WeightSyncError


async def push_to_all(engines: Sequence[Any], update: WeightUpdate
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


async def with_peer(server_call: Awaitable[Any],
                    peer: Callable[[], Awaitable[None]] | None) -> None:
    """Run the server's call and the trainer's side (`peer`) together; the first failure is
    raised as itself (a trainer-side failure as `WeightSyncError`), the other side is
    cancelled."""
    async def trainer_side() -> None:
        assert peer is not None
        try:
            await peer()
        except (EngineError, WeightSyncError, asyncio.CancelledError):
            raise
        except Exception as e:  # the trainer's collective: any failure ends the update
            raise WeightSyncError(f"trainer side of the weight sync failed: {e!r}") from e

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server_call)  # type: ignore[arg-type]
            if peer is not None:
                tg.create_task(trainer_side())
    except BaseExceptionGroup as eg:
        first = next((e for e in eg.exceptions
                      if not isinstance(e, asyncio.CancelledError)), eg.exceptions[0])
        raise first from None
