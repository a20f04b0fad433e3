"""The real sglang-router 0.3.2 (a Rust binary, no GPU needed) in front of SGLang fakes that
run as their own processes: registration (`POST /workers` 202, then polled), streaming
through it, a weight push to every worker, and a worker whose update fails taken out while
the run goes on (each worker counts as an engine for the all-failed rule).

`sglang-router==0.3.2` comes with the dev extra, so the default suite runs it; elsewhere it is
skipped unless `sglang_router` is importable or installed in `.venv-router` (the `router`
fixture, conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from fakes.control import FakeProcess
from remote_helpers import FAST, listed, make_request

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import collect
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.router import RoutedSGLangEngine
from asyncrl.weightsync.push import push_weights

STATE = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[FakeProcess, FakeProcess]]:
    launch = ("sglang_server.py", "--model-path", "/fake/model",
              "--incremental-streaming-output")
    with FakeProcess(*launch) as a, FakeProcess(*launch) as b:
        yield a, b


async def test_real_router_streams_and_takes_a_worker_out_when_its_update_fails(
        router, workers, session, tmp_path):
    a, b = workers
    cfg = SGLangEngineConfig(tp_size=1)
    servers = [SGLangEngine(cfg, index=i, session=session, url=w.url, options=FAST)
               for i, w in enumerate(workers)]
    async with RoutedSGLangEngine(router, servers, register=True) as routed:
        assert await listed(session, router) == {a.url, b.url}
        g = await collect(routed, make_request(max_new=5))
        assert len(g.token_ids) == 5 and g.finish_reason == "length"
        trainer = SimpleNamespace(state_dict_for_sync=lambda: STATE)
        await push_weights([routed], trainer, 1, "tensor", tmp_path)
        assert [s.policy_version for s in servers] == [1, 1]
        # worker a fails its update: it is taken out, the run goes on with b
        await a.reply("/update_weights_from_tensor", 500, {"detail": "CUDA error"})
        await push_weights([routed], trainer, 2, "tensor", tmp_path)
        assert [s.policy_version for s in servers] == [1, 2] and routed.policy_version == 2
        async with asyncio.timeout(15):
            while a.url in await listed(session, router):  # noqa: ASYNC110  (router state)
                await asyncio.sleep(0.2)
        before = len(await a.calls("/generate"))
        for _ in range(4):  # round robin over what is left: b only, on the new weights
            deltas = [d async for d in routed.stream(make_request(max_new=3))]
            assert {d.policy_version for d in deltas} == {2}
        assert len(await a.calls("/generate")) == before
        # an update that a takes again puts it back behind the router
        await a.reply("/update_weights_from_tensor", None)
        await push_weights([routed], trainer, 3, "tensor", tmp_path)
        assert [s.name for s in routed.in_service] == ["sglang-0", "sglang-1"]
        assert await listed(session, router) == {a.url, b.url}
