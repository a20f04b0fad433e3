"""A plain Python function as a tool: its OpenAI function schema from its signature.

Owns `function_tool(fn)` (re-exported by `asyncrl.api` and `asyncrl`). Does not own the
tool protocol or how a tool's output is cut (`asyncrl.rollout.tools.FunctionTool`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, get_type_hints

from asyncrl.rollout.blocking import call_sync
from asyncrl.rollout.tools import FunctionTool

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}


def _schema(fn: Callable[..., Any], name: str | None, description: str | None) -> dict[str, Any]:
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        t = hints.get(pname, str)
        props[pname] = {"type": _JSON_TYPES.get(getattr(t, "__origin__", t), "string")}
        if param.default is param.empty:
            required.append(pname)
    doc = inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": name or fn.__name__,
        "description": description if description is not None else doc.split("\n\n")[0],
        "parameters": {"type": "object", "properties": props, "required": required}}}


def function_tool(fn: Callable[..., Any], *, name: str | None = None,
                  description: str | None = None, timeout_s: float = 30.0,
                  max_output_chars: int = 256) -> FunctionTool:
    """`fn` as a tool. Its schema comes from the signature (`int` -> integer, `float` ->
    number, `bool`, `str`, `list`, `dict`; other or missing hints -> string; parameters
    without a default are required) and the docstring's first paragraph. A sync `fn` runs on
    a daemon thread so it cannot stall the loop, and one that never returns is cut at
    `timeout_s` without keeping the process alive; its return value is turned into text."""
    schema = _schema(fn, name, description)
    if asyncio.iscoroutinefunction(fn):
        call = fn
    else:
        what = f"tool {schema['function']['name']!r}"

        async def call(**arguments: Any) -> str:
            # a daemon thread: a call that never returns is cut by the deadline and cannot
            # keep the process alive (asyncrl.rollout.blocking)
            return str(await call_sync(fn, what=what, **arguments))
    return FunctionTool(call, schema, timeout_s=timeout_s, max_output_chars=max_output_chars)
