"""Tools the model can call during a rollout.

Owns: the `Tool` protocol (a name, an OpenAI-style function schema, an async call returning a
`ToolOutcome`), `PythonTool` (the `python_code_with_standard_io` tool over a sandbox client)
and `FunctionTool` (any async callable + schema, for embedding). Does not own: parsing calls
out of model text (`formats`), or where the output goes (the agent loop).

Contract of a tool call: `await tool(arguments)` returns a `ToolOutcome` whose `output` is the
model-facing text (already cut to the tool's limit). Bad arguments raise `ToolCallError` (the
agent loop answers the model with the message, status `malformed`). Anything else that goes
wrong on the tool's side is returned as status `sandbox_failure`, never raised: a tool never
kills a rollout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from asyncrl import formats
from asyncrl.errors import ToolCallError
from asyncrl.log import get_logger
from asyncrl.records import ToolStatus

log = get_logger(__name__)


class ToolOutcome(msgspec.Struct, kw_only=True):
    """What one tool call produced."""

    status: ToolStatus
    output: str
    """Model-facing text (formatted and cut by the tool)."""
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    """Execution time reported by the tool (sandbox run time for `PythonTool`)."""
    error: str = ""
    """Why the call failed on the tool's side (sandbox detail, exception text)."""


@runtime_checkable
class Tool(Protocol):
    """A callable tool: `name`, an OpenAI function `schema`, and `await tool(arguments)`."""

    name: str
    schema: dict[str, Any]

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutcome: ...


def _failure(error: str, duration_s: float, max_chars: int,
             status: ToolStatus = ToolStatus.SANDBOX_FAILURE, show_time: bool = True
             ) -> ToolOutcome:
    shown = duration_s if show_time else None
    return ToolOutcome(status=status, error=error, duration_s=duration_s,
                       output=formats.render_tool_result(status.value, "", error, shown,
                                                         max_chars))


_STATUS = {s.value: s for s in ToolStatus}


class PythonTool:
    """`python_code_with_standard_io(code, input)` run in the sandbox.

    `PythonTool(client, *, time_limit_s=4.0, max_output_chars=256, call_timeout_s=None,
    show_time=True)`:
    `client` is a `sandbox.SandboxClient` (opened by the caller); `time_limit_s` is the program's
    wall-clock limit; `max_output_chars` cuts stdout and stderr in the middle for the model;
    `call_timeout_s` (default `time_limit_s + 10`) is the deadline on the whole client call,
    transport included; `show_time` puts the measured run time in the text the model reads
    (`rollout.tool_time`; `ToolOutcome.duration_s` holds it either way). Maps
    `ExecResult.status` to `ToolStatus` and renders the model-facing text with
    `formats.render_tool_result`.
    """

    def __init__(self, client: Any, *, time_limit_s: float = 4.0, max_output_chars: int = 256,
                 call_timeout_s: float | None = None, show_time: bool = True) -> None:
        from sandbox import ExecRequest  # imported here, not on the first call's fire path

        self._request = ExecRequest
        self.client = client
        self.name = formats.PYTHON_TOOL
        self.schema = formats.PYTHON_TOOL_SCHEMA
        self.time_limit_s = time_limit_s
        self.max_output_chars = max_output_chars
        self.call_timeout_s = call_timeout_s if call_timeout_s is not None else time_limit_s + 10.0
        self.show_time = show_time

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        code = arguments.get("code")
        stdin = arguments.get("input", "")
        if not isinstance(code, str):
            raise ToolCallError(f'{self.name} needs a string argument "code"')
        if stdin is None:
            stdin = ""
        if not isinstance(stdin, str):
            raise ToolCallError(f'{self.name}: argument "input" must be a string')
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                res = await self.client.execute(
                    self._request(code=code, stdin=stdin, time_limit_s=self.time_limit_s))
        except TimeoutError:
            return _failure(f"sandbox did not answer within {self.call_timeout_s:.1f}s",
                            time.perf_counter() - t0, self.max_output_chars,
                            show_time=self.show_time)
        except Exception as e:  # any client/transport error is the sandbox's, not the model's
            log.warning("tool_sandbox_error", tool=self.name, error=repr(e))
            return _failure(f"sandbox error: {e!r}", time.perf_counter() - t0,
                            self.max_output_chars, show_time=self.show_time)
        status = _STATUS.get(str(res.status), ToolStatus.SANDBOX_FAILURE)
        text = formats.render_tool_result(status.value, res.stdout, res.stderr,
                                          res.duration_s if self.show_time else None,
                                          self.max_output_chars)
        return ToolOutcome(status=status, output=text, stdout=res.stdout, stderr=res.stderr,
                           exit_code=res.exit_code, duration_s=res.duration_s,
                           error=getattr(res, "detail", "") or "")


class FunctionTool:
    """Any async callable as a tool: `FunctionTool(fn, schema, *, max_output_chars=256,
    timeout_s=30.0)`.

    `fn(**arguments)` returns the model-facing text (cut in the middle to `max_output_chars`)
    or a `ToolOutcome`. `schema` is an OpenAI function schema
    (`{"type": "function", "function": {"name": ..., "parameters": ...}}`); its name is the tool
    name. A `TypeError` from the call (missing/unknown argument) is a malformed call; the
    deadline is status `timeout` (the call ran too long, as a program past its time limit); any
    other exception is `sandbox_failure` (the tool's own fault, not the model's).
    """

    def __init__(self, fn: Callable[..., Awaitable[str | ToolOutcome]], schema: dict[str, Any],
                 *, max_output_chars: int = 256, timeout_s: float = 30.0) -> None:
        self.fn = fn
        self.schema = schema
        self.name = str(schema.get("function", schema).get("name", getattr(fn, "__name__", "tool")))
        self.max_output_chars = max_output_chars
        self.timeout_s = timeout_s

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self.fn(**arguments)
        except TypeError as e:
            raise ToolCallError(f"{self.name}: {e}") from None
        except TimeoutError:
            return _failure(f"tool did not answer within {self.timeout_s:.1f}s",
                            time.perf_counter() - t0, self.max_output_chars, ToolStatus.TIMEOUT)
        except Exception as e:  # a user tool's bug is reported to the model, not raised
            return _failure(f"{type(e).__name__}: {e}", time.perf_counter() - t0,
                            self.max_output_chars)
        if isinstance(out, ToolOutcome):
            return out
        return ToolOutcome(status=ToolStatus.OK,
                           output=formats.cut_middle(str(out), self.max_output_chars),
                           stdout=str(out), duration_s=time.perf_counter() - t0)
