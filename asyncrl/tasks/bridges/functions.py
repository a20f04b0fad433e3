"""A plain Python function as a tool: its OpenAI function schema from its signature.

Owns `function_tool(fn)` (re-exported by `asyncrl.api` and `asyncrl`). Does not own the
tool protocol or how a tool's output is cut (`asyncrl.rollout.tools.FunctionTool`).
"""

from __future__ import annotations

import asyncio
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

from asyncrl.rollout.blocking import call_sync
from asyncrl.rollout.tools import FunctionTool

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object", tuple: "array", set: "array"}


def json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a parameter's type hint: `X | None` and `Optional[X]` are X's (a
    parameter with a default may be left out, which is how a model passes None), `list[X]`,
    `tuple[X, ...]` and `set[X]` arrays with X's items, `dict[...]` objects, `Literal[...]`
    an enum of its values; a union of several types, `Any` and unknown hints are strings."""
    origin = get_origin(hint)
    args = get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        return json_schema(rest[0]) if len(rest) == 1 else {"type": "string"}
    if origin is typing.Literal and args:
        kinds = {type(a) for a in args}
        kind = _JSON_TYPES.get(kinds.pop(), "string") if len(kinds) == 1 else "string"
        return {"type": kind, "enum": list(args)}
    base = origin if origin is not None else hint
    out: dict[str, Any] = {"type": _JSON_TYPES.get(base, "string")}
    if out["type"] == "array" and args and args[0] is not Ellipsis:
        out["items"] = json_schema(args[0])
    return out


def _schema(fn: Callable[..., Any], name: str | None, description: str | None) -> dict[str, Any]:
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        t = hints.get(pname, str)
        props[pname] = json_schema(t)
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
    number, `bool`, `str`, `list[X]`, `dict`; `X | None` / `Optional[X]` -> X's type; other
    or missing hints -> string, see `json_schema`; parameters without a default are
    required) and the docstring's first paragraph. A sync `fn` runs on a daemon thread so it
    cannot stall the loop, and one that never returns is cut at `timeout_s` without keeping
    the process alive; its return value is turned into text."""
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
