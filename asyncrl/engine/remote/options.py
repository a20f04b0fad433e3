"""Process-level knobs of remote engines (`RemoteOptions`) and where launched servers log.

Owns: `RemoteOptions` (interpreter and launcher, host, server environment, log directory,
and every interval, deadline and budget of `remote.RemoteEngine`'s supervision, control
calls, weight updates and load cache) and `with_log_dir`. A frozen config value; it imports
nothing from the project. Does not own: what uses the knobs (`remote.RemoteEngine`).
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class RemoteOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Process-level knobs of remote engines that are not part of a curriculum.

    Defaults suit a real run; tests shorten the intervals.
    """

    python: str = ""
    """Interpreter that has the server installed ("" = this interpreter)."""
    launcher: tuple[str, ...] = ()
    """Replaces `[python, -m, <server module>]` in the launch command (wrappers, fakes)."""
    host: str = "127.0.0.1"
    """Interface launched servers listen on (and the host in their URL)."""
    log_dir: str = ""
    """Directory for server logs (the run directory's `engines/`); "" = a temp directory."""
    env: dict[str, str] = {}
    """Extra environment for launched servers."""
    startup_timeout_s: float = 900.0
    """A launched server that is not healthy by then is a failed launch."""
    health_interval_s: float = 5.0
    """Seconds between health probes of a server."""
    health_timeout_s: float = 30.0
    """Deadline of one probe (SGLang's `/health` generates a token and answers 503 after
    20 s without one, so this must exceed 20 s to see the 503 rather than a timeout)."""
    health_failures: int = 3
    """Consecutive failed probes before a server is marked down."""
    control_timeout_s: float = 30.0
    """Deadline of one control call (load scrape, abort, pause, flush)."""
    weight_timeout_s: float = 900.0
    """Deadline of one weight update, pause and resume included."""
    load_ttl_s: float = 0.25
    """A load scrape is reused for this long."""
    routed_experts: tuple[int, ...] = ()
    """Routing replay on an MoE model: (sparse layers, experts per token) of the served
    model; requests then ask for the experts the routers chose (an engine that supports it)."""
    max_restarts: int = 5
    """Relaunches of one server before it stays down."""
    stop_grace_s: float = 20.0
    """SIGTERM → SIGKILL grace when stopping a launched server."""


def with_log_dir(options: RemoteOptions | None, run_dir: str | Path | None) -> RemoteOptions:
    """`options` with server logs under `run_dir/engines` unless a log dir is set already."""
    options = options or RemoteOptions()
    if run_dir and not options.log_dir:
        options = msgspec.structs.replace(options, log_dir=str(Path(run_dir) / "engines"))
    return options
