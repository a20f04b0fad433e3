"""Token-exact multi-turn against the real Qwen3 and Qwen2.5 chat templates (tests/templates/).

A scripted policy writes what a model trained on the template writes; the real agent loop runs
its calls in the real sandbox; the rollout's ids must equal what `apply_chat_template` renders
for the same conversation, and the SFT renderer must give the same ids and the loop's mask.
Also: Qwen3 dropping earlier reasoning (verl #6719) splits a multi-query chat instead of
training turns the model never generated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio
from fakes.scripted_engine import ScriptedEngine

from asyncrl import formats
from asyncrl.errors import ConfigError
from asyncrl.records import RolloutStatus, StopReason, ToolStatus
from asyncrl.rollout import PythonTool, RolloutSettings, run_rollout
from asyncrl.sft.coldstart import tokenize
from asyncrl.sft.layouts import Conversation, check
from asyncrl.sft.render import render
from asyncrl.templates import ChatTemplate, TemplateError, bind_format

sandbox = pytest.importorskip("sandbox")

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {"qwen3": "qwen3.jinja", "qwen2.5": "qwen2.5-instruct.jinja"}
TOOLS = [formats.PYTHON_TOOL_SCHEMA]
QUESTION = "What is the sum of the integers below 10?"


def make_tokenizer(template: str | None):
    """A byte-level BPE tokenizer built here whose vocabulary has Qwen's markup as single
    tokens: `<|im_start|>`/`<|im_end|>` special, `<tool_call>`, `<tool_response>`, `<think>`
    and their closers as added tokens (as in Qwen's tokenizer)."""
    from asyncrl.modeling import train_tokenizer

    corpus = [QUESTION, "I will compute it with Python. The sum is 45.", "Execution failed",
              "print(sum(range(10)))", "ZeroDivisionError: division by zero", "Time: 0.01s"] * 20
    tok = train_tokenizer(corpus, vocab_size=400)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    tok = make_tokenizer((TEMPLATES / FAMILIES[request.param]).read_text())
    return request.param, tok, bind_format(formats.HERMES, tok, "model")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    async with sandbox.SandboxPool(sandbox.PoolConfig(workers=1, time_limit_s=4.0)) as pool:
        async with sandbox.LocalSandboxClient(pool) as c:
            yield c


def _call(content: str, code: str) -> str:
    """An assistant turn as the template renders it: content, a newline, the Hermes call."""
    return (content + "\n" if content else "") + formats.HERMES.render_call(code)


def test_bound_format_keeps_the_builtin_hermes_text(family) -> None:
    """Both templates list tools and wrap tool results exactly as the built-in Hermes text, so
    the prompts RL used before are unchanged: only now they come from the template."""
    fmt = family[2]
    assert fmt.template is not None and fmt.name == "hermes"
    assert formats.render_prompt(QUESTION, fmt, TOOLS) == formats.render_prompt(
        QUESTION, formats.HERMES, TOOLS)
    assert fmt.tool_response("X\nY") == formats.HERMES.tool_response("X\nY")
    assert formats.render_prompt(QUESTION, fmt, TOOLS).endswith("<|im_start|>assistant\n")


@pytest.mark.asyncio(loop_scope="module")
async def test_multi_turn_rollout_ids_equal_the_template(family, client) -> None:
    name, tok, fmt = family
    think = "<think>\n\n</think>\n\n" if name == "qwen3" else ""  # Qwen3: the last message's
    final = "The sum is 45. <answer>\\boxed{45}</answer>"           # (empty) think block
    turns = [_call("I will compute it with Python.", "print(sum(range(10)))"),
             _call("", "print(1/0)"),
             think + final + "<|im_end|>"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    settings = RolloutSettings(max_response_tokens=2048, temperature=0.0, tool_format=fmt,
                               stop_token_ids=(eos,))
    engine = ScriptedEngine([tok.encode(t, add_special_tokens=False) for t in turns], tok)
    prompt = formats.render_prompt(QUESTION, fmt, TOOLS)
    ro = await run_rollout(engine, tok, [PythonTool(client)], settings, prompt)
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.EOS
    assert [c.status for c in ro.tool_calls] == [ToolStatus.OK, ToolStatus.ERROR]
    assert ro.tool_calls[0].stdout == "45\n"

    messages = [
        {"role": "system", "content": formats.HERMES_SYSTEM_HEAD},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "I will compute it with Python.",
         "tool_calls": [{"type": "function", "function": {
             "name": formats.PYTHON_TOOL,
             "arguments": {"code": "print(sum(range(10)))", "input": ""}}}]},
        {"role": "tool", "content": ro.tool_calls[0].output},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": formats.PYTHON_TOOL, "arguments": {"code": "print(1/0)", "input": ""}}}]},
        {"role": "tool", "content": ro.tool_calls[1].output},
        {"role": "assistant", "content": final},
    ]
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                       return_dict=False)
    rendered = list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    loop_ids = ro.prompt_ids + ro.response_ids
    # The one deliberate difference: the template ends the conversation with "<|im_end|>\n";
    # the loop stops at the end-of-turn token (nothing after it is generated).
    assert tok.decode(rendered[len(loop_ids):]) == "\n"
    assert loop_ids == rendered[:len(loop_ids)]

    # The SFT renderer, fed the same conversation, trains exactly what RL sees: same ids, and
    # the loss mask on the model's own tokens only.
    (segs,) = render(check(Conversation(messages=messages, tools=TOOLS)), fmt)
    ids, mask = tokenize(segs, tok)
    assert ids == loop_ids
    assert mask == [0] * len(ro.prompt_ids) + ro.loss_mask


def test_qwen3_earlier_reasoning_is_not_trained_as_dropped() -> None:
    """verl #6719: Qwen3's template drops the reasoning of turns before the last user query;
    training the whole rendering would teach answers without the reasoning the model wrote.
    The renderer splits such a chat per query: each turn is trained as it was generated."""
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"}]
    conv = check(Conversation(messages=msgs))
    q3 = bind_format(formats.HERMES, make_tokenizer((TEMPLATES / "qwen3.jinja").read_text()))
    assert "r1" not in q3.template.render(msgs)  # what the naive whole rendering would train
    examples = render(conv, q3)
    trained = [[s.text for s in ex if s.trained] for ex in examples]
    assert trained == [["<think>\nr1\n</think>\n\na1<|im_end|>"],
                       ["<think>\nr2\n</think>\n\na2<|im_end|>"]]
    # the second example's context is the history as the model saw it when answering q2
    assert "a1<|im_end|>" in examples[1][0].text and "r1" not in examples[1][0].text
    # Qwen2.5 renders prefixes stably: one example, both turns trained
    q25 = bind_format(formats.HERMES,
                      make_tokenizer((TEMPLATES / "qwen2.5-instruct.jinja").read_text()))
    (one,) = render(conv, q25)
    assert [s.text for s in one if s.trained] == [msgs[1]["content"] + "<|im_end|>",
                                                  msgs[3]["content"] + "<|im_end|>"]


def test_templates_that_cannot_serve_are_refused_or_skipped() -> None:
    plain = make_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TemplateError, match=r"ChatML|Hermes"):
        ChatTemplate(plain).tool_wrapper()
    assert bind_format(formats.HERMES, plain, "auto") is formats.HERMES
    with pytest.raises(ConfigError, match=r"data\.chat_template"):
        bind_format(formats.HERMES, plain, "model")
    with pytest.raises(ConfigError, match="puts nothing between messages"):
        bind_format(formats.MARKDOWN, plain, "model")
    assert bind_format(formats.MARKDOWN, make_tokenizer(None)) is formats.MARKDOWN


@pytest.mark.parametrize("system_prompt", ["", "Answer in <answer></answer>."])
def test_chat_sft_rows_without_a_system_message_get_the_rl_prompts_system(family, system_prompt
                                                                         ) -> None:
    """SFT rows and RL prompts must open with the same system text: a row without a system
    message gets `data.system_prompt` (or the run's default), never the template's own."""
    _, _, fmt = family
    conv = check(Conversation(messages=[{"role": "user", "content": QUESTION},
                                        {"role": "assistant", "content": "45"}], tools=TOOLS))
    (example,) = render(conv, fmt, system_prompt)
    rl_prompt = formats.render_prompt(QUESTION, fmt, TOOLS, system_prompt)
    assert example[0].text == rl_prompt
    own = check(Conversation(messages=[{"role": "system", "content": "Row's own."},
                                       *conv.messages], tools=TOOLS))
    assert "Row's own." in render(own, fmt, system_prompt)[0][0].text  # a row's own stays
