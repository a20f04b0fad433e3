"""Chat rows of the public function-calling and instruction sets, as one conversation layout.

Owns: `Conversation` (OpenAI-style `messages` and `tools`), converting a row of each supported
layout into one, and checking it. Pure functions, no I/O. Does not own: reading files and
counting bad rows (`asyncrl.sft.chat`), rendering (`asyncrl.sft.render`).

Layouts (`LAYOUTS`; `detect_layout` picks one from a row's keys; docs/recipe.md lists the sets):
- `openai`   `messages` (system / user / assistant with optional `tool_calls`, `tool` results;
             the legacy `function_call` / `function` role too), optional `tools` (function
             schemas, bare or wrapped in `{"type": "function"}`);
- `sharegpt` `conversations` of `{from, value}` (human / gpt / system; LLaMA-Factory's
             `function_call` and `observation` turns), optional `system` and `tools`;
- `hermes`   ShareGPT whose `gpt` turns hold `<tool_call>{...}</tool_call>` blocks, `tool` turns
             `<tool_response>` blocks and whose system text lists `<tools>[...]</tools>`
             (NousResearch/hermes-function-calling-v1): calls and tools are lifted out and the
             Hermes system text is dropped (the model's template writes its own tool block);
- `glaive`   glaive-function-calling-v2: `system` ("SYSTEM: ... -" then function JSON objects)
             and `chat` ("USER:" / "ASSISTANT:" / "FUNCTION RESPONSE:" turns,
             `<functioncall> {...}` calls, `<|endoftext|>` ends);
- `toolace`  ToolACE: ShareGPT with user / assistant / tool turns, calls written as Python
             (`[f(a=1), g(b="x")]`), tools as a JSON list inside the system text (which is
             dropped: its call syntax is not the model's);
- `xlam`     APIGen / xlam-function-calling-60k: `query`, `answers` (calls), `tools` (name,
             description, `parameters` as `{name: {type, description, default}}`);
- `alpaca`   instruction sets: `instruction`, optional `input` and `system`, `output`.

A row that cannot be converted or checked raises `BadRow` with a counter reason.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

ROLES = ("system", "user", "assistant", "tool")


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    """One chat in OpenAI layout, checked: every `content` a string, every call
    `{"type": "function", "function": {"name": str, "arguments": dict}}`, every `tool` message
    answering a call made before it, and at least one assistant message."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = []


class BadRow(Exception):
    """A row that cannot become a `Conversation`; `reason` is its counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ------------------------------------------------------------------------------ helpers
def _literal(source: str | ast.AST) -> Any:
    """`ast.literal_eval`, with every way it rejects model-written text as `ValueError`.

    Besides ValueError and SyntaxError it raises TypeError (`{[1]: 2}`: an unhashable key) and
    RecursionError or MemoryError (deep nesting): a bad row, never an aborted load."""
    try:
        return ast.literal_eval(source)
    except (TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a Python literal ({type(e).__name__})") from None


def _json_or_literal(text: str) -> Any:
    """JSON, or the Python literal some sets write instead (single quotes, True/None)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _literal(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _maybe_json(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise BadRow("bad_json", f"{what} is a string but not JSON: {e.msg}") from None
    return value


def _arguments(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRow("bad_arguments", f"call {name!r}: arguments are not valid JSON "
                         f"({e.msg} at position {e.pos})") from None
    if not isinstance(value, dict):
        raise BadRow("bad_arguments", f"call {name!r}: arguments must be a JSON object, got "
                     f"{type(value).__name__}")
    return value


def tool_call(name: Any, arguments: Any) -> dict[str, Any]:
    """A call in the checked layout; raises `BadRow` for a bad name or arguments."""
    if not isinstance(name, str) or not name.strip():
        raise BadRow("bad_tool_call", f"tool call without a name: {name!r}")
    return {"type": "function", "function": {"name": name, "arguments": _arguments(arguments, name)}}


def _call_of(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadRow("bad_tool_call", f"tool call must be an object, got {type(obj).__name__}")
    fn = obj.get("function", obj)
    if not isinstance(fn, dict):
        raise BadRow("bad_tool_call", "tool call's `function` must be an object")
    return tool_call(fn.get("name"), fn.get("arguments", {}))


def _schema(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise BadRow("bad_tools", f"a tool must be an object, got {type(tool).__name__}")
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRow("bad_tools", "a tool needs a `name` (or `function.name`)")
    return {"type": "function", "function": fn}


def _tools(value: Any) -> list[dict[str, Any]]:
    value = _maybe_json(value, "tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRow("bad_tools", f"tools must be a list, got {type(value).__name__}")
    return [_schema(t) for t in value]


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(value) and all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    if not isinstance(value, str):
        raise BadRow("bad_content", f"{where}: content must be a string, got "
                     f"{type(value).__name__}")
    return value


# ------------------------------------------------------------------------------- layouts
_OPENAI_ALIASES = {"function": "tool", "developer": "system"}
"""The legacy `function` role (results of `function_call`) and the newer `developer` role."""


def from_openai(row: Mapping[str, Any]) -> Conversation:
    msgs = row.get("messages")
    if not isinstance(msgs, list):
        raise BadRow("bad_messages", "`messages` must be a list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRow("bad_messages", f"message {i} is not an object")
        if "role" not in m or m["role"] in (None, ""):
            raise BadRow("missing_role", f"message {i} has no role")
        role = _OPENAI_ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role {role!r}; expected one of {ROLES}")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"message {i}")}
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            calls = _maybe_json(m.get("tool_calls") or [m["function_call"]],
                                f"message {i} tool_calls")
            if not isinstance(calls, list):
                raise BadRow("bad_tool_call", f"message {i}: tool_calls must be a list")
            msg["tool_calls"] = [_call_of(c) for c in calls]
        out.append(msg)
    return Conversation(messages=out, tools=_tools(row.get("tools")))


_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "model": "assistant", "function_call": "assistant",
                   "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
                   "function_response": "tool"}


def from_sharegpt(row: Mapping[str, Any]) -> Conversation:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise BadRow("bad_messages", "`conversations` must be a list")
    msgs: list[dict[str, Any]] = []
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        msgs.append({"role": "system", "content": system})
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow("bad_messages", f"turn {i} is not an object")
        who = t.get("from", t.get("role"))
        if who in (None, ""):
            raise BadRow("missing_role", f"turn {i} has no `from`")
        role = _SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            raise BadRow("unknown_role", f"turn {i} is from {who!r}")
        value = _text(t.get("value", t.get("content")), f"turn {i}")
        if who == "function_call":
            calls = _maybe_json(value, f"turn {i} function_call")
            calls = calls if isinstance(calls, list) else [calls]
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [_call_of(c) for c in calls]})
        else:
            msgs.append({"role": role, "content": value})
    return Conversation(messages=msgs, tools=_tools(row.get("tools")))


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_HERMES_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)
_HERMES_TOOLS = re.compile(r"<tools>\s*(.*?)\s*</tools>", re.S)


def from_hermes(row: Mapping[str, Any]) -> Conversation:
    conv = from_sharegpt({**row, "tools": None})
    tools: list[dict[str, Any]] = _tools(row.get("tools"))
    msgs: list[dict[str, Any]] = []
    for m in conv.messages:
        text = m["content"]
        blocks = [b for b in _HERMES_TOOLS.findall(text) if b.strip()]
        if m["role"] == "system" and blocks:
            try:  # the text also names the tags ("within <tools> </tools> XML tags")
                listed = _json_or_literal(blocks[-1])
            except (ValueError, SyntaxError) as e:
                raise BadRow("bad_tools", f"<tools> block is not JSON: {e}") from None
            tools = _tools(listed if isinstance(listed, list) else [listed])
            continue  # the Hermes system text: the template writes its own tool block
        if m["role"] == "assistant" and _HERMES_CALL.search(text):
            calls = []
            for body in _HERMES_CALL.findall(text):
                try:
                    calls.append(_call_of(_json_or_literal(body)))
                except (ValueError, SyntaxError):
                    raise BadRow("bad_arguments", f"tool call is not valid JSON: {body[:80]!r}"
                                 ) from None
            msgs.append({"role": "assistant", "content": _HERMES_CALL.sub("", text).strip(),
                         "tool_calls": calls})
        elif m["role"] == "tool" and _HERMES_RESPONSE.search(text):
            msgs += [{"role": "tool", "content": r} for r in _HERMES_RESPONSE.findall(text)]
        else:
            msgs.append(m)
    return Conversation(messages=msgs, tools=tools)


_GLAIVE_TURN = re.compile(r"(?:^|\n)\s*(USER|ASSISTANT|FUNCTION RESPONSE):\s?")
_GLAIVE_CALL = re.compile(r"<functioncall>\s*(.*)$", re.S)


def _json_objects(text: str) -> tuple[str, list[Any]]:
    """(text before the first object, every JSON object that follows, in order)."""
    dec = json.JSONDecoder()
    start = text.find("{")
    if start < 0:
        return text, []
    objs, i = [], start
    while i < len(text):
        if text[i] in " \t\r\n":
            i += 1
            continue
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise BadRow("bad_tools", f"function list is not JSON: {e.msg}") from None
        objs.append(obj)
    return text[:start], objs


def _glaive_call(body: str) -> dict[str, Any]:
    body = body.strip()
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        pass
    # glaive writes `"arguments": '{...}'`: JSON text in single quotes
    name = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    args = re.search(r'"arguments"\s*:\s*\'(.*)\'\s*}\s*$', body, re.S)
    if name is None or args is None:
        raise BadRow("bad_tool_call", f"cannot read the functioncall {body[:80]!r}")
    return tool_call(name.group(1), args.group(1))


def from_glaive(row: Mapping[str, Any]) -> Conversation:
    system, chat = row.get("system"), row.get("chat")
    if not isinstance(chat, str):
        raise BadRow("bad_messages", "`chat` must be a string")
    msgs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if isinstance(system, str) and system.strip():
        text = re.sub(r"^\s*SYSTEM:\s*", "", system)
        head, objs = _json_objects(text)
        tools = _tools(objs)
        head = head.strip().rstrip("-").strip()
        if head:
            msgs.append({"role": "system", "content": head})
    parts = _GLAIVE_TURN.split(chat)
    if parts[0].strip():
        raise BadRow("missing_role", f"text before the first role marker: {parts[0][:60]!r}")
    role_of = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
    for who, value in zip(parts[1::2], parts[2::2], strict=True):
        value = value.replace("<|endoftext|>", "").strip()
        call = _GLAIVE_CALL.search(value) if who == "ASSISTANT" else None
        if call is not None:
            msgs.append({"role": "assistant", "content": value[:call.start()].strip(),
                         "tool_calls": [_glaive_call(call.group(1))]})
        else:
            msgs.append({"role": role_of[who], "content": value})
    return Conversation(messages=msgs, tools=tools)


def _split_calls(body: str) -> list[str]:
    """`f(a=1), g(b="x, y")` -> the calls, split at top-level commas (quotes and brackets
    respected)."""
    items: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in body:
        if quote:
            quote = "" if ch == quote and (not cur or cur[-1] != "\\") else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    items.append("".join(cur).strip())
    return [i for i in items if i]


def _python_calls(text: str) -> list[dict[str, Any]] | None:
    """`[f(a=1), Market Trends API(b="x")]` (ToolACE's syntax: names may hold spaces) as calls,
    or None when `text` is not such a list."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    calls = []
    for item in _split_calls(text[1:-1]):
        paren = item.find("(")
        if paren <= 0 or not item.endswith(")"):
            return None
        name = item[:paren].strip()
        try:
            call = ast.parse("f" + item[paren:], mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(call, ast.Call) or call.args:
            return None
        try:
            args = {k.arg: _literal(k.value) for k in call.keywords if k.arg}
        except ValueError:
            raise BadRow("bad_arguments", f"call {name!r}: arguments are not literals") from None
        calls.append(tool_call(name, args))
    return calls or None


def from_toolace(row: Mapping[str, Any]) -> Conversation:
    conv = from_sharegpt({**row, "system": None, "tools": None})
    system = row.get("system") or ""
    tools: list[dict[str, Any]] = []
    start = system.find("[") if isinstance(system, str) else -1
    if start >= 0:
        try:
            listed, _ = json.JSONDecoder().raw_decode(system, start)
        except json.JSONDecodeError as e:
            raise BadRow("bad_tools", f"the system text's function list is not JSON: {e.msg}"
                         ) from None
        tools = _tools(listed)
    msgs = []
    for m in conv.messages:
        calls = _python_calls(m["content"]) if m["role"] == "assistant" else None
        msgs.append({"role": "assistant", "content": "", "tool_calls": calls} if calls else m)
    return Conversation(messages=msgs, tools=tools or _tools(row.get("tools")))


def _xlam_tool(t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise BadRow("bad_tools", "an xlam tool needs a `name`")
    params = t.get("parameters") or {}
    if isinstance(params, dict) and params.get("type") != "object":
        props = {k: {kk: vv for kk, vv in v.items() if kk != "default"}
                 if isinstance(v, dict) else v for k, v in params.items()}
        required = [k for k, v in params.items() if not (isinstance(v, dict) and "default" in v)]
        params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": t["name"],
                                             "description": t.get("description", ""),
                                             "parameters": params}}


def from_xlam(row: Mapping[str, Any]) -> Conversation:
    answers = _maybe_json(row.get("answers"), "answers")
    tools = _maybe_json(row.get("tools"), "tools")
    if not isinstance(answers, list) or not isinstance(tools, list):
        raise BadRow("bad_messages", "`answers` and `tools` must be lists")
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": _text(row.get("query"), "query")},
        {"role": "assistant", "content": "", "tool_calls": [_call_of(a) for a in answers]}]
    return Conversation(messages=msgs, tools=[_xlam_tool(t) for t in tools])


def from_alpaca(row: Mapping[str, Any]) -> Conversation:
    instruction = _text(row.get("instruction"), "instruction")
    extra = _text(row.get("input"), "input")
    msgs = []
    if isinstance(row.get("system"), str) and row["system"].strip():
        msgs.append({"role": "system", "content": row["system"]})
    msgs += [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra.strip() else "")},
             {"role": "assistant", "content": _text(row.get("output"), "output")}]
    return Conversation(messages=msgs)


LAYOUTS: dict[str, Callable[[Mapping[str, Any]], Conversation]] = {
    "openai": from_openai, "sharegpt": from_sharegpt, "hermes": from_hermes,
    "glaive": from_glaive, "toolace": from_toolace, "xlam": from_xlam, "alpaca": from_alpaca,
}


def detect_layout(row: Mapping[str, Any]) -> str:
    """The layout a row is in, from its keys (and, for ShareGPT rows, its markup)."""
    if "messages" in row:
        return "openai"
    if "conversations" in row:
        text = json.dumps(row, ensure_ascii=False)
        if "<tool_call>" in text or "<tools>" in text:
            return "hermes"
        if "JSON format that you can invoke" in str(row.get("system") or ""):
            return "toolace"
        return "sharegpt"
    if "chat" in row and "system" in row:
        return "glaive"
    if "query" in row and "answers" in row:
        return "xlam"
    if "instruction" in row and "output" in row:
        return "alpaca"
    raise BadRow("unknown_layout", f"no known chat layout has the keys {sorted(row)[:8]}")


def to_conversation(row: Any, layout: str = "auto") -> Conversation:
    """Convert and check one row; raises `BadRow`."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object", f"row must be a JSON object, got {type(row).__name__}")
    name = detect_layout(row) if layout == "auto" else layout
    if name not in LAYOUTS:
        raise ValueError(f"unknown chat layout {layout!r}; expected auto or one of {sorted(LAYOUTS)}")
    return check(LAYOUTS[name](row))


def check(conv: Conversation) -> Conversation:
    """Raise `BadRow` unless every tool message answers a call made before it (since the last
    user message) and some assistant message says or calls something."""
    pending = 0
    said = False
    for i, m in enumerate(conv.messages):
        role = m["role"]
        if role == "assistant":
            pending = len(m.get("tool_calls") or [])
            said = said or bool(m["content"].strip()) or pending > 0
        elif role == "tool":
            if pending == 0:
                raise BadRow("tool_without_call", f"message {i} is a tool result but no call "
                             "is waiting for one")
            pending -= 1
        elif role == "user":
            pending = 0
    if not said:
        raise BadRow("no_assistant", "no assistant message with content or a call")
    return conv
