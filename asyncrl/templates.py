"""The model's own chat template as the one source of conversation text for SFT and the agent loop.

Owns: `ChatTemplate` (rendering with the tokenizer's `chat_template` through transformers'
`apply_chat_template`, the jinja the model was trained with), the tool-response wrapper derived
from it (the text between an assistant's `</tool_call>` and the next generation), and
`bind_format`: a `ToolFormat` whose prompt and tool responses come from the template, so that
the ids the agent loop builds for a multi-turn rollout are the ids the template renders for the
same conversation. Does not own: splitting a conversation into trained and untrained spans
(`asyncrl.sft.render`), parsing calls (`asyncrl.formats`).

Token-exactness, and its deliberate limits (docs/recipe.md "Token-exact templates"):
- the prompt is the template's rendering of `[system, user]` with the generation prompt; a
  tool result is appended as `head + output + tail`, both probed from the template;
- the model's own turns are kept as generated (token-in, token-out, never re-rendered), so they
  equal the template's rendering when the model writes the canonical text the template
  produces (`content`, a newline, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`)
  — which is what SFT on the template's rendering teaches it;
- Qwen3's template renders the *last* assistant message with a `<think>` block (empty when it
  has no reasoning) and drops reasoning from turns before the last user query: within one
  rollout (one user query) the only effect is that a final answer starts with
  `<think>\\n\\n</think>\\n\\n`, which SFT teaches; a chat with several user queries is split by
  the SFT renderer so every turn is trained as it was generated (verl #6719 is the failure of
  re-rendering such histories).

Templates are supported where they are ChatML (`<|im_start|>role\\n ... <|im_end|>`, the Qwen
families) and render calls the Hermes way; anything else is a `TemplateError` naming what was
missing, and `bind_format(..., mode="auto")` then keeps the built-in text. The markdown format
also sits on templates with no tool support (SmolLM2's ChatML, Gemma 2/3's `<start_of_turn>`
turns, which raise on a `tool` or `system` message: the output then comes back in a `user`
message and the system text is folded into the first user turn).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from asyncrl import formats
from asyncrl.errors import ConfigError, DataError
from asyncrl.log import get_logger

log = get_logger(__name__)

SENTINEL = "\ue000asyncrl-probe\ue001"
"""Private-use characters that no real text contains: marks where content lands in a probe."""
SENTINEL2 = "\ue002asyncrl-probe\ue003"
ASSISTANT_HEADER = f"{formats.IM_START}assistant\n"
CALL_CLOSE = "</tool_call>"

Mode = Literal["auto", "model", "builtin"]

Message = Mapping[str, Any]


class TemplateError(DataError):
    """A chat template cannot be used the way asyncrl needs (no template, not ChatML, no
    Hermes tool calls, or it raised while rendering)."""


class ChatTemplate:
    """`ChatTemplate(tokenizer)`: the tokenizer's `chat_template` (or `template`), rendered
    with transformers' jinja. Stateless apart from a cached probe; safe to share."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        tpl = template if template is not None else getattr(tokenizer, "chat_template", None)
        if not isinstance(tpl, str) or not tpl.strip():
            raise TemplateError("the tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.template = tpl
        self._wrapper: tuple[str, str] | None = None
        self._turn: tuple[str, str, str] | None = None

    def render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
               *, add_generation_prompt: bool = False) -> str:
        """The template's text for `messages` (OpenAI layout) with `tools` listed its way."""
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
                chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises many types (UndefinedError, TemplateError, TypeError...)
            raise TemplateError(f"the chat template failed to render: {e}") from e
        return str(text)

    def prompt(self, question: str, tools: Sequence[Mapping[str, Any]] | None,
               system: str = "") -> str:
        """`[system, user]` with the generation prompt: what the engine sees first. A template
        that refuses a system message (Gemma 2's) gets the system text folded into the user
        turn, `system + "\n\n" + question`, as Gemma 3's own template folds it."""
        user: Message = {"role": "user", "content": question}
        if not system:
            return self.render([user], tools, add_generation_prompt=True)
        try:
            return self.render([{"role": "system", "content": system}, user], tools,
                               add_generation_prompt=True)
        except TemplateError:
            folded: Message = {"role": "user", "content": f"{system}\n\n{question}"}
            return self.render([folded], tools, add_generation_prompt=True)

    def tool_wrapper(self) -> tuple[str, str]:
        """(head, tail): after a call's `</tool_call>`, the loop appends `head + output + tail`
        (the end of the assistant message, the tool message, the next generation prompt)."""
        if self._wrapper is None:
            probe: list[Message] = [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function",
                                      "function": {"name": "f", "arguments": {}}}]},
                     {"role": "tool", "content": SENTINEL}]
            text = self.render(probe, add_generation_prompt=True)
            close = text.rfind(CALL_CLOSE)
            if ASSISTANT_HEADER not in text:
                raise TemplateError("the chat template is not ChatML (no "
                                    f"{ASSISTANT_HEADER!r} header)")
            if close < 0 or text.count(SENTINEL) != 1 or text.find(SENTINEL) < close:
                raise TemplateError("the chat template does not render tool calls the Hermes "
                                    "way (<tool_call>...</tool_call>, then the tool message)")
            head, tail = text[close + len(CALL_CLOSE):].split(SENTINEL)
            if not tail.endswith(ASSISTANT_HEADER):
                raise TemplateError("the chat template's generation prompt is not the bare "
                                    f"{ASSISTANT_HEADER!r} header")
            self._wrapper = (head, tail)
        return self._wrapper

    def tool_response(self, output: str) -> str:
        head, tail = self.tool_wrapper()
        return head + output + tail

    def turn_wrapper(self) -> tuple[str, str, str]:
        """(head, tail, role) for a template without tool calls: after the model's turn ends on
        a call (a markdown fence), the loop appends `head + output + tail` — the end of the
        assistant message, a message of `role` holding the output, the next generation
        prompt — which is the template's rendering of `[..., assistant, role]`. `role` is
        `tool` when the template renders that role with its content, else `user`."""
        if self._turn is None:
            failed: list[str] = []
            for role in ("tool", "user"):
                probe: list[Message] = [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": SENTINEL},
                                        {"role": role, "content": SENTINEL2}]
                try:  # Gemma's template raises on a `tool` message (roles must alternate)
                    text = self.render(probe, add_generation_prompt=True)
                except TemplateError as e:
                    failed.append(f"{role}: {e}")
                    continue
                if text.count(SENTINEL) == 1 and text.count(SENTINEL2) == 1:
                    head, tail = text.split(SENTINEL, 1)[1].split(SENTINEL2)
                    break
                failed.append(f"{role}: the content is dropped")
            else:
                raise TemplateError("the chat template renders no message after an "
                                    f"assistant's with its content ({'; '.join(failed)})")
            if not tail or not head:
                raise TemplateError("the chat template puts nothing between messages")
            self._turn = (head, tail, role)
        return self._turn

    def end_of_turn(self) -> str:
        """The special token the template ends an assistant message with (ChatML's
        `<|im_end|>`, Gemma's `<end_of_turn>`): the text right after the message's content."""
        head = self.turn_wrapper()[0]
        specials = sorted(special_tokens(self.tokenizer), key=len, reverse=True)
        for tok in specials:
            if head.startswith(tok):
                return tok
        raise TemplateError("the chat template ends an assistant message with "
                            f"{head[:20]!r}, not a special token of the tokenizer")


def bind_format(fmt: formats.ToolFormat, tokenizer: Any, mode: Mode = "auto"
                ) -> formats.ToolFormat:
    """`fmt` with its prompt and tool responses taken from the model's chat template.

    `mode`: `builtin` keeps the format's own text; `model` requires the template (a
    `ConfigError` on `data.chat_template` says why it cannot be used); `auto` uses it when the
    format is Hermes and the template renders Hermes calls in ChatML, else keeps the built-in
    text (the markdown format, tokenizers made on the spot without a tool-aware template).
    """
    if mode == "builtin":
        return fmt
    if fmt.name != "hermes":
        if mode == "model":
            return _bind_markdown(fmt, tokenizer)
        return fmt
    try:
        tpl = ChatTemplate(tokenizer)
        tpl.tool_wrapper()
    except TemplateError as e:
        if mode == "model":
            raise ConfigError("data.chat_template", str(e)) from None
        log.info("chat_template_not_used", reason=str(e))
        return fmt

    def prompt(question: str, tools: list[dict[str, Any]] | None, system_prompt: str) -> str:
        return tpl.prompt(question, tools, formats.template_system_text(fmt, tools, system_prompt))

    return dataclasses.replace(fmt, _response=tpl.tool_response, _prompt=prompt, template=tpl)


def _bind_markdown(fmt: formats.ToolFormat, tokenizer: Any) -> formats.ToolFormat:
    """The markdown format on top of the model's own turns (a template with no tool support,
    e.g. SmolLM2's ChatML): the prompt is the template's `[system, user]` rendering with the
    format's system text (no tool list: the template would not render it, or would render it
    the Hermes way), a Python fence ends the assistant message, and the output comes back as
    an ```output block in a message the template renders (`ChatTemplate.turn_wrapper`)."""
    try:
        tpl = ChatTemplate(tokenizer)
        head, tail, _ = tpl.turn_wrapper()
        eot = tpl.end_of_turn()
    except TemplateError as e:
        raise ConfigError("data.chat_template", str(e)) from None

    def prompt(question: str, tools: list[dict[str, Any]] | None, system_prompt: str) -> str:
        return tpl.prompt(question, None, system_prompt or fmt.system_prompt(tools))

    def response(text: str) -> str:
        return head + fmt.tool_response(text).rstrip("\n") + tail

    return dataclasses.replace(fmt, _response=response, _prompt=prompt, template=tpl,
                               end_of_turn=eot)


def special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens, its added special tokens included (`<|im_end|>`,
    `<end_of_turn>`)."""
    out = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content))
    return sorted(out)


def end_of_sequence_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a rollout: the tokenizer's EOS, the token its chat template ends an
    assistant message with (when it has a template that can say), and ChatML's `<|im_end|>`
    when the vocabulary has it (the built-in formats write it). Never the unknown token."""
    ids: list[int] = []
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    unk = getattr(tokenizer, "unk_token_id", None)

    def add(i: Any) -> None:
        if isinstance(i, int) and i >= 0 and i != unk and i not in ids:
            ids.append(i)

    eos = getattr(tokenizer, "eos_token_id", None)
    add(eos)
    if convert is not None:
        try:
            add(convert(ChatTemplate(tokenizer).end_of_turn()))
        except TemplateError:
            pass  # no template, or one that cannot say: EOS (and <|im_end|>) only
        add(convert(formats.IM_END))
    return tuple(ids)
