"""The command line: ``sandbox serve`` arguments -> ``PoolConfig`` -> ``server.serve``.

``main`` is ``python -m sandbox serve ...`` / ``python -m sandbox probe``;
``add_serve_arguments(parser)`` + ``run_serve(args)`` are what ``asyncrl sandbox serve`` wires
in. The server knows nothing of the command line: this module imports it, never the reverse.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys

from .auth import DEFAULT_TOKEN_ENV, load_token, require_token_for
from .config import DEFAULT_PRELOAD, IsolationLevel, PoolConfig
from .errors import SandboxError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = PoolConfig()
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; the endpoint "
                                          "runs arbitrary code: any other address needs a token)")
    a("--token-file", default=None,
      help="file holding the shared auth token (clients send it as a bearer token); the token "
           "is never taken from the command line")
    a("--token-env", default=DEFAULT_TOKEN_ENV,
      help="environment variable holding the token when no --token-file is given "
           f"(default {DEFAULT_TOKEN_ENV}); removed from the environment once read, so nothing "
           "started from here inherits it")
    a("--port", type=int, default=8787, help="port (0 = any free port, printed at start)")
    a("--workers", type=int, default=d.workers, help="zygote worker processes")
    a("--isolation", default=d.isolation.value, choices=[v.value for v in IsolationLevel],
      help="required isolation level (auto = strongest available)")
    a("--jail", default=d.jail, choices=("auto", "nsjail", "bwrap"))
    a("--time-limit", type=float, default=d.time_limit_s, help="default per-call limit, s")
    a("--max-time-limit", type=float, default=d.max_time_limit_s,
      help="largest per-call limit a request may ask for, s")
    a("--memory-mb", type=int, default=d.memory_mb)
    a("--max-output-bytes", type=int, default=d.max_output_bytes)
    a("--max-processes", type=int, default=d.max_processes)
    a("--max-file-mb", type=int, default=d.max_file_mb)
    a("--tmp-mb", type=int, default=d.tmp_mb)
    a("--queue-limit", type=int, default=d.queue_limit)
    a("--max-inflight-per-worker", type=int, default=d.max_inflight_per_worker)
    a("--max-batch", type=int, default=1024, help="largest batch one request may carry")
    a("--front-ends", type=int, default=1,
      help="HTTP front-end processes sharing the port, each with its own share of --workers "
           "(see sandbox.frontends); 1 = this process serves")
    a("--preload", default=",".join(DEFAULT_PRELOAD),
      help="comma-separated modules the zygotes import (prefix with + to add to the default)")
    a("--python-path", action="append", default=[],
      help="extra sys.path directory for the workers (repeatable)")
    a("--shutdown-grace", type=float, default=30.0,
      help="seconds to let running batches finish on SIGTERM")
    a("--no-huge-pages", action="store_true", help="do not back zygote heaps with THP")


def config_from_args(args: argparse.Namespace) -> PoolConfig:
    preload = args.preload
    if preload.startswith("+"):
        modules = list(DEFAULT_PRELOAD) + [m for m in preload[1:].split(",") if m]
    else:
        modules = [m for m in preload.split(",") if m]
    return PoolConfig(
        workers=args.workers, isolation=IsolationLevel(args.isolation), jail=args.jail,
        time_limit_s=args.time_limit, max_time_limit_s=args.max_time_limit,
        memory_mb=args.memory_mb, max_output_bytes=args.max_output_bytes,
        max_processes=args.max_processes, max_file_mb=args.max_file_mb, tmp_mb=args.tmp_mb,
        queue_limit=args.queue_limit, max_inflight_per_worker=args.max_inflight_per_worker,
        preload=tuple(dict.fromkeys(modules)), python_paths=tuple(args.python_path),
        huge_pages=not args.no_huge_pages)


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_serve(args: argparse.Namespace) -> int:
    """Start the server from parsed ``add_serve_arguments`` args; returns an exit code."""
    from .frontends import FrontEnd, supervise
    from .server import serve

    _configure_logging()
    try:
        cfg = config_from_args(args)
        token = load_token(args.token_file, args.token_env)
        if args.token_env:  # nothing started from here (workers, jails) should inherit it
            os.environ.pop(args.token_env, None)
        require_token_for(args.host, token)
        if args.front_ends == 1:
            return _run(serve(cfg, host=args.host, port=args.port, max_batch=args.max_batch,
                              shutdown_grace_s=args.shutdown_grace, token=token))

        def front_end(cfg_i: PoolConfig, socks: list[socket.socket], fe: FrontEnd,
                      ready_fd: int) -> int:
            ready = os.fdopen(ready_fd, "w")

            def on_ready(line: str) -> None:
                ready.write(line + "\n")
                ready.close()  # the supervisor counts closed pipes as "done starting"

            return _run(serve(cfg_i, host=args.host, port=args.port, max_batch=args.max_batch,
                              shutdown_grace_s=args.shutdown_grace, token=token, socks=socks,
                              front_end=fe, on_ready=on_ready))

        return supervise(cfg, args.front_ends, args.host, args.port, front_end)
    except SandboxError as exc:
        print(f"sandbox serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the address: in use, not ours, unresolvable
        print(f"sandbox serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2


def _configure_logging() -> None:
    """Standalone server: structured logs to stderr (stdout carries the ready line).
    Leaves an embedding application's structlog configuration alone."""
    import structlog

    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def run_probe(args: argparse.Namespace) -> int:
    from .isolation import available_levels

    print(json.dumps(available_levels(PoolConfig(jail=args.jail)), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sandbox serve ...`` / ``python -m sandbox probe``."""
    parser = argparse.ArgumentParser(
        prog="sandbox", description="``sandbox serve``: the executor pool behind an aiohttp "
                                    "HTTP endpoint, one per sandbox node.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run the HTTP sandbox server")
    add_serve_arguments(serve_p)
    probe_p = sub.add_parser("probe", help="print which isolation levels work on this host")
    probe_p.add_argument("--jail", default="auto", choices=("auto", "nsjail", "bwrap"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    return run_probe(args)
