"""Chat and tool-call formats: the text contract between the model, the agent loop and SFT.

Owns: the system prompt, the prompt layout (Qwen ChatML), the Python tool's schema, the two
tool-call syntaxes (Hermes `<tool_call>{json}</tool_call>` and markdown ```python fences), how a
tool result is rendered back to the model, and the answer markup. Does not own: running tools
(the agent loop) or scoring answers (the reward).

A format is chosen by name from `FORMATS` (`rollout.tool_format`). Each gives:
- `stop_strings`: where an assistant turn pauses for a tool (the closing tag is kept).
- `parse(turn_text)`: the tool call that closed the turn, a `Malformed` call, or None.
- `tool_response(text)`: the text appended after the call, loss mask 0, after which the model
  continues generating. For Hermes this closes the assistant message and opens a `user` message
  with `<tool_response>` (what Qwen's template renders), then reopens the assistant; for
  markdown it is an ```output fence inside the same assistant message.

Imports nothing from the project.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

PYTHON_TOOL = "python_code_with_standard_io"

PYTHON_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL,
        "description": (
            "Execute Python code as a fresh program with `input` on stdin and return its "
            "stdout and stderr. If the last statement is an expression, its value is printed."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run."},
                "input": {"type": "string", "description": "Text given to the program on stdin."},
            },
            "required": ["code"],
        },
    },
}

ANSWER_INSTRUCTION = (
    "Reason step by step inside <reason> </reason>, then give the final answer inside "
    "<answer> </answer>, with the final value in \\boxed{}."
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Call:
    """A parsed tool call."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class Malformed:
    """A tool call that could not be parsed; `error` is told to the model."""

    error: str
    raw: str


@dataclass(frozen=True)
class ToolFormat:
    name: str
    stop_strings: tuple[str, ...]
    system_template: str
    _parse: Any = field(repr=False)
    _response: Any = field(repr=False)
    _render_call: Any = field(repr=False)
    _prompt: Any = field(default=None, repr=False)
    """`(question, tools, system_prompt) -> text`; None: the built-in ChatML layout."""
    template: Any = field(default=None, repr=False)
    """The model's `templates.ChatTemplate` when the prompt and tool responses come from it
    (`templates.bind_format`); None for the built-in text."""
    _continues: Any = field(default=None, repr=False)
    """`(turn_text) -> bool`: the turn stopped on a stop string that is text, not a call."""
    end_of_turn: str = IM_END
    """The text that ends an assistant message (SFT transcripts train it): ChatML's
    `<|im_end|>`, or the model template's own end-of-turn token (`templates.bind_format`)."""
    only_tool: str | None = None
    """The one tool this syntax can call (markdown: the Python tool); None: any tool."""

    def __str__(self) -> str:
        return self.name

    def uncallable(self, tool_names: list[str]) -> str:
        """Why some of `tool_names` could never be called in this format (empty: all can).
        The one rule for curricula (`asyncrl.tasks.check`, the runtime) and the embedding
        API: a model trained or prompted with such a tool would never see it."""
        bad = [n for n in tool_names if self.only_tool is not None and n != self.only_tool]
        if not bad:
            return ""
        return (f"the {self.name} tool format calls only {self.only_tool}; "
                f"{', '.join(bad)} could never be called")

    def parse(self, turn_text: str) -> Call | Malformed | None:
        """The call that ends `turn_text` (text of one assistant turn), if any."""
        return self._parse(turn_text)

    def continues(self, turn_text: str) -> bool:
        """True when `turn_text` (a turn that stopped on a stop string and parses to no call)
        ended on text that only looks like a call's end: the agent loop keeps generating the
        same turn. Markdown: a bare opening fence or a closed non-Python block."""
        return bool(self._continues(turn_text)) if self._continues is not None else False

    def tool_response(self, text: str) -> str:
        """Text appended after a call (mask 0); the model continues right after it."""
        return self._response(text)

    def render_call(self, code: str, stdin: str = "") -> str:
        """How the model writes a call to the Python tool (for SFT transcripts)."""
        return self._render_call(code, stdin)

    def system_prompt(self, tools: list[dict[str, Any]] | None) -> str:
        if not tools:
            return "You are a helpful assistant. " + ANSWER_INSTRUCTION
        return self.system_template.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
            answer=ANSWER_INSTRUCTION, tool_phrase=_tool_phrase(tools),
        )


# ------------------------------------------------------------------------------------ hermes
HERMES_SYSTEM_HEAD = ("You are a helpful assistant that solves problems with careful reasoning "
                      "and a Python tool.\n" + ANSWER_INSTRUCTION)
"""The Hermes system text before its tool list: with a chat template, the system message (the
template writes the `# Tools` block itself, in the same words as `_HERMES_SYSTEM`). Without the
Python tool among the tools it says "tools" (`hermes_system_head`)."""


def _tool_phrase(tools: list[dict[str, Any]] | None) -> str:
    """How the Hermes system text names what the model has: "a Python tool" when the Python
    tool is among `tools`, else "tools" (a task's own tools, listed below it)."""
    names = {(t.get("function") or t).get("name") for t in tools or []}
    return "a Python tool" if PYTHON_TOOL in names or not tools else "tools"


def hermes_system_head(tools: list[dict[str, Any]] | None) -> str:
    """`HERMES_SYSTEM_HEAD`, naming the tools `tools` offers (`_tool_phrase`)."""
    return HERMES_SYSTEM_HEAD.replace("a Python tool", _tool_phrase(tools), 1)


_HERMES_SYSTEM = (
    "You are a helpful assistant that solves problems with careful reasoning and {tool_phrase}.\n"
    "{answer}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _hermes_parse(text: str) -> Call | Malformed | None:
    # The call runs from the first opener to a closer that only whitespace follows: what
    # `re.search(r"<tool_call>(.*?)</tool_call>\s*$", text, re.S)` matches (the test checks
    # the two agree), with string searches, for it runs on every call's fire path.
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return None
    end = len(text.rstrip()) - len(_HERMES_CLOSE)
    if end < start + len(_HERMES_OPEN) or not text.startswith(_HERMES_CLOSE, end):
        return None
    raw = text[start:]
    body = text[start + len(_HERMES_OPEN):end].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return Malformed(f"tool call is not valid JSON: {e.msg} at position {e.pos}", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Malformed('tool call must be an object with a "name" string', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Malformed('"arguments" must be a JSON object', raw)
    if not isinstance(args, dict):
        return Malformed('"arguments" must be a JSON object', raw)
    return Call(obj["name"], args, raw)


def _hermes_response(text: str) -> str:
    return (f"{IM_END}\n{IM_START}user\n<tool_response>\n{text}\n</tool_response>{IM_END}\n"
            f"{IM_START}assistant\n")


def _hermes_render(code: str, stdin: str) -> str:
    args = {"code": code, "input": stdin}
    return "<tool_call>\n" + json.dumps({"name": PYTHON_TOOL, "arguments": args}) + "\n</tool_call>"


HERMES = ToolFormat("hermes", ("</tool_call>",), _HERMES_SYSTEM, _hermes_parse, _hermes_response,
                    _hermes_render)


# ---------------------------------------------------------------------------------- markdown
_MD_SYSTEM = (
    "You are a helpful assistant. To run Python, write a ```python code block; its output "
    "will be shown in an ```output block. {answer}"
)
_MD_OPEN = "```python\n"
# The closing fence may share its token with more whitespace ("```" + "\n\n" in SmolLM2's
# BPE): the engine stops inside that token, so the turn can end with more than one newline.
_MD_CALL = re.compile(r"```python\n(.*?)```[ \t]*(?:\n\s*)?$", re.S)
_MD_FENCE_END = re.compile(r"```[^`\n]*[ \t]*\n\s*$")


def _md_parse(text: str) -> Call | Malformed | None:
    m = _MD_CALL.search(text)
    if m is None:
        return None
    code = m.group(1)
    if not code.strip():
        return Malformed("empty python block", m.group(0))
    return Call(PYTHON_TOOL, {"code": code, "input": ""}, m.group(0))


def _md_continues(text: str) -> bool:
    # Only reached when the turn parses to no Python call: whatever fence ended it (an opening
    # ``` or ```js, the close of a non-Python block) is prose to go on from, not a call.
    return _MD_FENCE_END.search(text) is not None


def _md_response(text: str) -> str:
    return f"```output\n{text}\n```\n"


def _md_render(code: str, stdin: str) -> str:
    del stdin  # the markdown format has no stdin channel
    return f"{_MD_OPEN}{code.rstrip()}\n```\n"


MARKDOWN = ToolFormat("markdown", ("```\n",), _MD_SYSTEM, _md_parse, _md_response, _md_render,
                      _continues=_md_continues, only_tool=PYTHON_TOOL)

FORMATS: dict[str, ToolFormat] = {"hermes": HERMES, "markdown": MARKDOWN}


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}; expected one of {sorted(FORMATS)}") from None


# ---------------------------------------------------------------------------------- prompts
def template_system_text(fmt: ToolFormat, tools: list[dict[str, Any]] | None,
                         system_prompt: str = "") -> str:
    """The system message a run puts before a conversation the model's chat template renders
    (RL prompts and chat-file SFT rows without their own): `data.system_prompt` when set, else
    the Hermes head when tools are listed (the template writes the tool block itself), else
    the format's own system text."""
    return system_prompt or (hermes_system_head(tools) if tools else fmt.system_prompt(None))


def render_prompt(question: str, fmt: ToolFormat, tools: list[dict[str, Any]] | None,
                  system_prompt: str = "") -> str:
    """The prompt text up to and including the assistant's generation header: the format's
    own ChatML layout, or the model's chat template when `fmt` is bound to one."""
    if fmt._prompt is not None:
        return str(fmt._prompt(question, tools, system_prompt))
    system = system_prompt or fmt.system_prompt(tools)
    return (f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{question}{IM_END}\n"
            f"{IM_START}assistant\n")


# --------------------------------------------------------------------------- tool results
def cut_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of `text` so the whole is at most about `max_chars` characters."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} characters cut]...\n"
    head = max_chars // 2
    tail = max_chars - head
    return text[:head] + marker + text[len(text) - tail:]


def shows_tool_time(tool_time: str, seeded: bool) -> bool:
    """Whether tool outputs show their measured time, from `rollout.tool_time` and
    `rollout.seed_requests` (`seeded`): `auto` shows it only in unseeded runs."""
    return tool_time == "measured" or (tool_time == "auto" and not seeded)


def render_tool_result(status: str, stdout: str, stderr: str, duration_s: float | None,
                       max_chars: int) -> str:
    """What the model reads after a call: a status line, stdout then stderr (together cut in
    the middle to `max_chars`, so the head of the output and the last traceback line survive),
    and the execution time (`Time: 0.03s`; no line when `duration_s` is None:
    `rollout.tool_time`, a measured time differs from run to run)."""
    ok = status == "ok"
    head = "Execution succeeded." if ok else f"Execution failed ({status})."
    body = "\n".join(x.rstrip("\n") for x in (stdout, stderr) if x.strip())
    parts = [head]
    if body:
        parts.append(cut_middle(body, max_chars))
    if duration_s is not None:
        parts.append(f"Time: {duration_s:.2f}s")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------- answers
_BOXED = "\\boxed{"
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.S)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (balanced braces), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i = start + len(_BOXED)
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_answer(response: str) -> str | None:
    """The final answer: the last `\\boxed{}` inside the last `<answer>` block when there is one,
    else the last `\\boxed{}` anywhere."""
    blocks = _ANSWER_BLOCK.findall(response)
    if blocks:
        inner = last_boxed(blocks[-1])
        if inner is not None:
            return inner
    return last_boxed(response)


def answer_blocks(response: str) -> int:
    """Number of complete `<answer>…</answer>` blocks (RoC's format penalty reads it)."""
    return len(_ANSWER_BLOCK.findall(response))
