"""SGLang fleets: an `[engine] kind = "sglang"` table turned into engines.

Owns: the registry's builder for SGLang (`build_sglang_engines`: attach to `cfg.urls` or launch
`cfg.num_servers` servers (`remote.fleet.build_servers`), one `SGLangEngine` each; with `cfg.router_url`,
one `RoutedSGLangEngine` over them all) and `open_sglang_engines` (the same, started and
stopped on exit).

Does not own: a server's wire format or supervision (`sglang.SGLangEngine`), the router
(`sglang_router`), or starting engines concurrently (`remote.open_all`). Dependencies point
one way: this module imports `sglang` and `sglang_router`; neither imports it or each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.remote.engine import open_all
from asyncrl.engine.remote.fleet import build_servers
from asyncrl.engine.remote.options import RemoteOptions, with_log_dir
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.router import RoutedSGLangEngine

__all__ = ["build_sglang_engines", "open_sglang_engines"]


def build_sglang_engines(cfg: SGLangEngineConfig, *, model: Any = None, tokenizer: Any = None,
                         model_path: str = "", run_dir: str | Path | None = None,
                         session: aiohttp.ClientSession | None = None,
                         remote_options: RemoteOptions | None = None,
                         record_routing: bool = False,
                         routing_shape: tuple[int, ...] = (),
                         **_ignored: Any) -> list[Any]:
    """The registry's builder: engines for `[engine] kind = "sglang"`, not yet started.

    Attaches to `cfg.urls`, or launches `cfg.num_servers` servers loading `model_path` (an
    HF directory; the caller saves a model built from `model.init` first) with logs under
    `run_dir/engines`. With `cfg.router_url`, one `RoutedSGLangEngine` over all servers.
    `model`/`tokenizer` are for in-process kinds and ignored here. `record_routing` (routing
    replay) with `routing_shape` (sparse layers, experts per token): requests ask for the
    routed experts and launched servers run with `--enable-return-routed-experts`.
    """
    if record_routing:
        import msgspec

        remote_options = msgspec.structs.replace(remote_options or RemoteOptions(),
                                                 routed_experts=tuple(routing_shape[:2]))
    servers = build_servers(SGLangEngine, cfg, what="SGLang servers", model_path=model_path,
                            session=session, options=with_log_dir(remote_options, run_dir))
    if cfg.router_url:
        return [RoutedSGLangEngine(cfg.router_url, servers, register=not cfg.urls)]
    return servers


@contextlib.asynccontextmanager
async def open_sglang_engines(cfg: SGLangEngineConfig, **kw: Any) -> AsyncIterator[list[Any]]:
    """`build_sglang_engines(cfg, **kw)`, started; stopped on exit."""
    async with open_all(build_sglang_engines(cfg, **kw)) as engines:
        yield engines
