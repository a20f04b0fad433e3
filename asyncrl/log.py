"""structlog configuration, in one place.

Owns: how log events are rendered (JSON lines into the run directory; readable console on a TTY,
JSON lines otherwise) and the context bound to them (run id, stage, step, policy version,
rollout id) through contextvars. Everything else calls `get_logger(__name__)` and logs
snake_case event names with keyword values: `log.info("step_done", reward=0.4)`.

Embedded (nobody called `configure`, and the host has not configured structlog itself), every
event goes to the standard `logging` module under the emitting module's name (`asyncrl.…`):
the host's handlers and levels decide; with no logging set up at all, Python prints warnings
and errors to stderr and drops the rest. Nothing of the library ever writes to stdout.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO, Any, TextIO, cast

import structlog
from structlog.contextvars import bind_contextvars, bound_contextvars, clear_contextvars

__all__ = ["bind_contextvars", "bound_contextvars", "clear_contextvars", "configure", "get_logger",
           "use_host_logging"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
_json_file: IO[str] | None = None


class _Tee:
    """Renders each event twice: JSON to the run's log file, and a console rendering."""

    def __init__(self, console: Any | None, json_renderer: Any) -> None:
        self._console = console
        self._json = json_renderer

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> str:
        if _json_file is not None:
            _json_file.write(self._json(logger, name, dict(event)) + "\n")
            _json_file.flush()
        if self._console is None:
            raise structlog.DropEvent
        return self._console(logger, name, event)


class _CurrentStderr:
    """Writes to `sys.stderr` as it is at each line, not as it was at `configure`: a live
    progress display (`asyncrl.observe.progress`) swaps in rich's proxy, which prints log lines above
    the display instead of through it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str = "info", console: str = "auto", run_dir: Path | None = None,
              stream: IO[str] | None = None) -> None:
    """Configure structlog once per process. Safe to call again (e.g. when the run dir is known).

    Console lines go to `stream`, default the current `sys.stderr` at each line."""
    global _json_file
    if _json_file is not None:
        _json_file.close()
        _json_file = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        _json_file = (run_dir / "log.jsonl").open("a", encoding="utf-8")
    out: Any = stream if stream is not None else _CurrentStderr()
    mode = console
    if mode == "auto":
        mode = "rich" if out.isatty() else "json"
    json_renderer = structlog.processors.JSONRenderer()
    console_renderer: Any
    if mode == "none":
        console_renderer = None
    elif mode == "json":
        console_renderer = json_renderer
    else:
        console_renderer = structlog.dev.ConsoleRenderer(colors=(mode == "rich"))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _Tee(console_renderer, json_renderer),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, out)),
        cache_logger_on_first_use=False,
    )


def use_host_logging() -> None:
    """Send every event to the standard `logging` module (logger = the emitting module's name),
    rendered as one line: `event key=value ...`. The default when asyncrl is embedded."""
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"]),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


if not structlog.is_configured():  # a host that set up structlog itself keeps its setup
    use_host_logging()


def get_logger(name: str = "asyncrl") -> Any:
    return structlog.get_logger(name)
