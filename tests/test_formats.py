"""Tool-call formats: parsing, malformed calls, rendering, answer extraction."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import formats as F


def test_hermes_parse_ok_and_malformed() -> None:
    text = 'Let me compute.<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(2)", "input": ""}}\n</tool_call>'
    call = F.HERMES.parse(text)
    assert isinstance(call, F.Call) and call.arguments["code"] == "print(2)"
    bad = F.HERMES.parse('<tool_call>{"name": "x", "arguments": {</tool_call>')
    assert isinstance(bad, F.Malformed) and "JSON" in bad.error
    assert isinstance(F.HERMES.parse('<tool_call>[1]</tool_call>'), F.Malformed)
    assert isinstance(F.HERMES.parse('<tool_call>{"name": "x", "arguments": 3}</tool_call>'), F.Malformed)
    assert F.HERMES.parse("no call here <answer>\\boxed{3}</answer>") is None
    # double-encoded arguments are accepted
    call = F.HERMES.parse('<tool_call>{"name": "t", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert isinstance(call, F.Call) and call.arguments == {"a": 1}


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_call", "/tool_call>", "{}",
                                 '{"name": "t", "arguments": {}}', "x", " ", "\n", "\t",
                                 "\u2003", "\x1c", "\x85", "\u00a0", "\u200b", "\r\n"]),
                max_size=9))
def test_hermes_call_bounds_are_the_regex_reference(parts: list[str]) -> None:
    text = "".join(parts)
    m = re.search(r"<tool_call>(.*?)</tool_call>\s*$", text, re.S)
    got = F.HERMES.parse(text)
    if m is None:
        assert got is None
    else:
        assert got is not None and got.raw == m.group(0)
        body = m.group(1).strip()
        if body == '{"name": "t", "arguments": {}}':
            assert isinstance(got, F.Call) and got.name == "t"
        else:
            assert isinstance(got, F.Malformed)


def test_hermes_render_round_trips() -> None:
    text = F.HERMES.render_call("print('}')", "1 2")
    call = F.HERMES.parse(text)
    assert isinstance(call, F.Call)
    assert call.name == F.PYTHON_TOOL and call.arguments == {"code": "print('}')", "input": "1 2"}
    assert text.endswith(F.HERMES.stop_strings[0])


def test_markdown_parse_and_response() -> None:
    text = "I will compute.\n```python\nprint(12*34)\n```\n"
    assert text.endswith(F.MARKDOWN.stop_strings[0])
    call = F.MARKDOWN.parse(text)
    assert isinstance(call, F.Call) and call.arguments["code"] == "print(12*34)\n"
    assert isinstance(F.MARKDOWN.parse("```python\n   \n```\n"), F.Malformed)
    assert F.MARKDOWN.parse("plain text") is None
    assert F.MARKDOWN.tool_response("408") == "```output\n408\n```\n"
    assert F.MARKDOWN.parse(F.MARKDOWN.render_call("x = 1\nx")) is not None


def test_prompt_lists_tools_hermes_style() -> None:
    p = F.render_prompt("What is 2+2?", F.HERMES, [F.PYTHON_TOOL_SCHEMA])
    assert p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n")
    assert "<tools>" in p and F.PYTHON_TOOL in p and "\\boxed{}" in p


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<reason>..</reason><answer>The answer is \\boxed{42}.</answer>", "42"),
        ("\\boxed{1} then <answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("no markup but \\boxed{7}", "7"),
        ("<answer>no box</answer>", None),
        ("\\boxed{unclosed", None),
        ("<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>", "2"),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert F.extract_answer(text) == answer


def test_tool_result_cut_in_middle() -> None:
    out = F.render_tool_result("ok", "A" * 200 + "B" * 200, "", 0.012, 256)
    assert out.startswith("Execution succeeded.") and "characters cut" in out
    assert "AAAA" in out and out.rstrip().endswith("Time: 0.01s") and "BBBB" in out
    assert "failed (timeout)" in F.render_tool_result("timeout", "", "", 4.0, 256)


def test_the_hermes_system_text_names_the_python_tool_only_when_it_is_offered() -> None:
    """Issue 54 L6: with only a task's own tool (`count_letter`), the system text still said
    "...with careful reasoning and a Python tool"."""
    from asyncrl import formats

    other = {"type": "function", "function": {"name": "count_letter", "parameters": {}}}
    with_python = formats.HERMES.system_prompt([formats.PYTHON_TOOL_SCHEMA])
    assert "careful reasoning and a Python tool." in with_python
    only_other = formats.HERMES.system_prompt([other])
    assert "careful reasoning and tools." in only_other and "Python" not in only_other
    assert "Python" not in formats.template_system_text(formats.HERMES, [other])
    assert formats.template_system_text(formats.HERMES, [formats.PYTHON_TOOL_SCHEMA]) == \
        formats.HERMES_SYSTEM_HEAD


def test_tool_time_is_shown_only_where_runs_need_not_repeat():
    """`rollout.tool_time`: a measured time differs from run to run, so a seeded run (`auto`)
    and `none` show no time line; `measured` and an unseeded `auto` keep it."""
    from asyncrl.formats import render_tool_result, shows_tool_time

    assert render_tool_result("ok", "5\n", "", 0.034, 256) == "Execution succeeded.\n5\nTime: 0.03s"
    assert render_tool_result("ok", "5\n", "", None, 256) == "Execution succeeded.\n5"
    assert [shows_tool_time(t, s) for t in ("auto", "measured", "none") for s in (False, True)] \
        == [True, False, True, True, False, False]
