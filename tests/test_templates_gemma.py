"""Gemma 2/3 chat templates (tests/templates/gemma*-style.jinja: their control flow, which
raises on any role that breaks the user/assistant alternation, a `tool` message included) with
a tokenizer whose EOS is `<eos>`: the markdown format sits on the model's own turns with the
output in a `user` message, `<end_of_turn>` stops a rollout, and `data.chat_template = "model"`
is accepted (G8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import formats
from asyncrl.errors import ConfigError
from asyncrl.templates import ChatTemplate, bind_format, end_of_sequence_ids

TEMPLATES = Path(__file__).parent / "templates"
SYSTEM = "Solve the problem. To run Python, write a ```python block."


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def tok(request):
    from test_templates import make_tokenizer

    tok = make_tokenizer((TEMPLATES / f"{request.param}-style.jinja").read_text())
    tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>",
                            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def test_a_tool_message_falls_back_to_user(tok):
    head, tail, role = ChatTemplate(tok).turn_wrapper()
    assert role == "user"
    assert head == "<end_of_turn>\n<start_of_turn>user\n"
    assert tail == "<end_of_turn>\n<start_of_turn>model\n"


def test_end_of_turn_stops_a_rollout(tok):
    ids = end_of_sequence_ids(tok)
    assert tok.convert_tokens_to_ids("<end_of_turn>") in ids
    assert tok.convert_tokens_to_ids("<eos>") in ids


def test_markdown_binds_to_the_model_template_token_for_token(tok):
    """`data.chat_template = "model"` with the markdown format: the loop's text (prompt, the
    model's turn, the output wrapper) is the template's rendering of the same conversation,
    the system text folded into the first user turn (Gemma 2's template refuses a system
    message; Gemma 3's folds it the same way)."""
    fmt = bind_format(formats.MARKDOWN, tok, "model")
    assert fmt.end_of_turn == "<end_of_turn>"
    prompt = formats.render_prompt("What is 2 + 3?", fmt, None, SYSTEM)
    turn = "I will compute it.\n```python\nprint(2 + 3)\n```"
    loop = prompt + turn + fmt.tool_response("5")
    output = fmt.tool_response("5").split("<start_of_turn>user\n", 1)[1].split("<end_of_turn>")[0]
    rendered = ChatTemplate(tok).render(
        [{"role": "user", "content": SYSTEM + "\n\n" + "What is 2 + 3?"},
         {"role": "assistant", "content": turn}, {"role": "user", "content": output}],
        add_generation_prompt=True)
    assert loop == rendered
    assert prompt.startswith("<bos><start_of_turn>user\n" + SYSTEM + "\n\nWhat is 2 + 3?")


def test_hermes_on_a_gemma_template_is_still_refused_with_model(tok):
    with pytest.raises(ConfigError, match=r"data\.chat_template"):
        bind_format(formats.HERMES, tok, "model")
