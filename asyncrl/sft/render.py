"""A `Conversation` as the segments of text the agent loop would build, trained or not.

Owns: turning a checked conversation into `sft.Segment` lists (the model's own turns trained,
everything else context), with one of two renderers picked by the bound tool format:
- `template` (the format carries the model's `ChatTemplate`, see `asyncrl.templates`): the
  template renders the conversation; each assistant message is cut out of the ChatML text
  between its `<|im_start|>assistant\\n` header and its `<|im_end|>` (trained, the end token
  included) or, when it calls tools, its last `</tool_call>` (trained; the `<|im_end|>` and the
  tool message after it are context, exactly the tool response the loop appends, since the
  loop stops generating at `</tool_call>`). Text after the last trained span is dropped. When
  rendering a prefix of the chat is not a prefix of the whole (Qwen3 drops reasoning before the
  last user query, and gives the last assistant message an empty `<think>` block), the chat is
  split into one example per user query, earlier turns as context, so each turn is trained as
  it was generated.
- `builtin` (no template: the markdown format, tokenizers made on the spot): the format's own
  ChatML text, segment for segment what `asyncrl.sft.render_transcript` produces for the same
  transcript: the prompt, each assistant span (content, then its calls written with
  `fmt.render_call` for the Python tool, as Hermes JSON for any other tool, whatever the
  format: the markdown format has no syntax for them), each tool result wrapped
  by `fmt.tool_response`, and the end-of-turn token.

Segments are tokenized one by one (`sft.tokenize_many`), as the loop tokenizes the prompt and
each tool response on its own. Does not own: reading rows (`asyncrl.sft.chat`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl import formats
from asyncrl.sft.coldstart import Segment
from asyncrl.sft.layouts import BadRow, Conversation
from asyncrl.templates import ASSISTANT_HEADER, CALL_CLOSE, ChatTemplate, TemplateError


def render(conv: Conversation, fmt: formats.ToolFormat, system_prompt: str = ""
           ) -> list[list[Segment]]:
    """The examples (segment lists) of one conversation; raises `BadRow` (`template_error`)
    when the model's template cannot render it."""
    if fmt.template is not None:
        if not conv.messages or conv.messages[0]["role"] != "system":
            # the same system text as the run's RL prompts, not the template's own default
            system = formats.template_system_text(fmt, conv.tools or None, system_prompt)
            conv = msgspec.structs.replace(
                conv, messages=[{"role": "system", "content": system}, *conv.messages])
        return _template_examples(conv, fmt.template)
    return [_builtin_segments(conv, fmt, system_prompt)]


# ------------------------------------------------------------------------------ template
def _template_examples(conv: Conversation, tpl: ChatTemplate) -> list[list[Segment]]:
    msgs, tools = conv.messages, conv.tools or None
    try:
        full = tpl.render(msgs, tools)
        queries = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        stable = all(full.startswith(tpl.render(msgs[:q], tools)) for q in queries[1:])
        if stable or len(queries) < 2:
            return [_spans(full, msgs, train_from=0)]
        out = []
        for k, q in enumerate(queries):
            end = queries[k + 1] if k + 1 < len(queries) else len(msgs)
            if any(m["role"] == "assistant" for m in msgs[q:end]):
                out.append(_spans(tpl.render(msgs[:end], tools), msgs[:end], train_from=q))
        return out
    except TemplateError as e:
        raise BadRow("template_error", str(e)) from None


def _spans(text: str, msgs: Sequence[dict[str, Any]], train_from: int) -> list[Segment]:
    """Cut `text` (the template's rendering of `msgs`) into context and assistant spans;
    assistant messages before index `train_from` stay context."""
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if text.count(ASSISTANT_HEADER) != len(assistants):
        raise TemplateError(f"the template rendered {text.count(ASSISTANT_HEADER)} assistant "
                            f"headers for {len(assistants)} assistant messages")
    segs: list[Segment] = []
    done = 0  # end of the text already in segments
    at = 0
    for i in assistants:
        start = text.index(ASSISTANT_HEADER, at) + len(ASSISTANT_HEADER)
        end_tok = text.find(formats.IM_END, start)
        if end_tok < 0:
            raise TemplateError("an assistant message has no <|im_end|>")
        at = end_tok
        if i < train_from:
            continue
        if msgs[i].get("tool_calls"):
            close = text.rfind(CALL_CLOSE, start, end_tok)
            if close < 0:
                raise TemplateError("the template did not render an assistant's tool calls")
            end = close + len(CALL_CLOSE)
        else:
            end = end_tok + len(formats.IM_END)
        if start > done:
            segs.append(Segment(text[done:start], False))
        segs.append(Segment(text[start:end], True))
        done = end
    return segs


# ------------------------------------------------------------------------------- builtin
def _render_calls(fmt: formats.ToolFormat, calls: Sequence[dict[str, Any]]) -> str:
    out = []
    for c in calls:
        fn = c["function"]
        args = fn["arguments"]
        if fn["name"] == formats.PYTHON_TOOL and isinstance(args.get("code"), str):
            out.append(fmt.render_call(args["code"], str(args.get("input", ""))))
        else:  # any other tool (no syntax of its own in the markdown format): Hermes JSON
            out.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args},
                                                    ensure_ascii=False) + "\n</tool_call>")
    return "".join(out)


def _builtin_segments(conv: Conversation, fmt: formats.ToolFormat, system_prompt: str
                      ) -> list[Segment]:
    msgs = list(conv.messages)
    if msgs and msgs[0]["role"] == "system":
        system = msgs.pop(0)["content"]
    else:
        system = system_prompt or fmt.system_prompt(conv.tools or None)
    segs: list[Segment] = []
    context = f"{formats.IM_START}system\n{system}{formats.IM_END}\n"
    in_turn = False  # inside an assistant message (after a call whose result was appended)
    for m in msgs:
        role = m["role"]
        if role == "assistant":
            if not in_turn:
                context += ASSISTANT_HEADER
            if context:
                segs.append(Segment(context, False))
                context = ""
            content, calls = m["content"], m.get("tool_calls") or []
            if calls:
                sep = "" if not content or content.endswith("\n") else "\n"
                segs.append(Segment(content + sep + _render_calls(fmt, calls), True))
                in_turn = True
            else:
                segs += [Segment(content, True), Segment(formats.IM_END, True)]
                context, in_turn = "\n", False
        elif role == "tool":
            context += fmt.tool_response(m["content"])
            # hermes' wrapper reopens the assistant; markdown's stays inside its message
            in_turn = True
        else:
            if in_turn:  # a call's turn ends without an answer before the next message
                context += formats.IM_END + "\n"
                in_turn = False
            context += f"{formats.IM_START}{role}\n{m['content']}{formats.IM_END}\n"
    return [s for s in segs if s.text]
