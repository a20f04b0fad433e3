"""The agent loop on a scripted policy: tools fire mid-stream, outputs are masked, limits stop."""

from __future__ import annotations

import asyncio
import json

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl import formats
from asyncrl.errors import EngineUnavailable
from asyncrl.records import Rollout, RolloutStatus, StopReason, ToolStatus, from_json, to_json
from asyncrl.rollout import AgentLoop, FunctionTool, RolloutSettings, ToolOutcome, run_rollout

CALL = '<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(6*7)", "input": ""}}\n</tool_call>'
ANSWER = "So <answer>\\boxed{42}</answer><|im_end|>"


class EvalTool:
    """A stand-in Python tool: evaluates `print(expr)` programs; records when it ran."""

    name = formats.PYTHON_TOOL
    schema = formats.PYTHON_TOOL_SCHEMA

    def __init__(self, engine: ScriptedEngine | None = None, output: str | None = None) -> None:
        self.calls: list[dict] = []
        self.engine = engine
        self.requests_seen: list[int] = []
        self.output = output

    async def __call__(self, arguments: dict) -> ToolOutcome:
        self.calls.append(arguments)
        if self.engine is not None:
            self.requests_seen.append(len(self.engine.requests))
        await asyncio.sleep(0.01)
        out = self.output if self.output is not None else str(eval(arguments["code"].strip()[6:-1]))
        text = formats.render_tool_result("ok", out + "\n", "", 0.01, 256)
        return ToolOutcome(status=ToolStatus.OK, output=text, stdout=out + "\n", duration_s=0.01)


def _ids(tok, *texts: str) -> list[list[int]]:
    return [tok.encode(t) for t in texts]


def _settings(tok, **kw) -> RolloutSettings:
    return RolloutSettings(max_response_tokens=kw.pop("max_response_tokens", 512),
                           temperature=0.0, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
                           **kw)


PROMPT = formats.render_prompt("What is 6*7?", formats.HERMES, [formats.PYTHON_TOOL_SCHEMA])


async def test_tool_runs_before_the_stream_continues_and_output_is_masked(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "Let me compute. " + CALL, ANSWER), tok)
    tool = EvalTool(eng)
    ro = await run_rollout(eng, tok, [tool], _settings(tok), PROMPT, rollout_id="r1",
                           prompt_id="p", group_id="g", policy_version=3)
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.EOS
    assert tool.calls == [{"code": "print(6*7)", "input": ""}]
    assert tool.requests_seen == [1]  # the call ran after turn 1's stream, before turn 2's
    # turn 2's request already carries the tool output, appended as tokens with mask 0
    prompt_ids = tok.encode(PROMPT)
    assert ro.prompt_ids == prompt_ids
    second = eng.requests[1].input_ids
    assert second[: len(prompt_ids)] == prompt_ids
    tool_turn = ro.turns[1]
    assert tool_turn.role == "tool"
    tool_ids = ro.response_ids[tool_turn.start:tool_turn.end]
    assert second[len(prompt_ids):] == ro.response_ids[: tool_turn.end]
    assert "42" in tok.decode(tool_ids) and "<tool_response>" in tok.decode(tool_ids)
    assert ro.loss_mask[tool_turn.start:tool_turn.end] == [0] * len(tool_ids)
    assert all(ro.logprobs[i] == 0.0 for i in range(tool_turn.start, tool_turn.end))
    for t in (ro.turns[0], ro.turns[2]):
        assert t.role == "assistant" and set(ro.loss_mask[t.start:t.end]) == {1}
    assert ro.response_text == tok.decode(ro.response_ids)
    assert ro.response_text.endswith(ANSWER)
    assert ro.tool_calls[0].status == ToolStatus.OK and ro.tool_calls[0].wait_s > 0
    assert ro.turns[0].tool_call == 0 and ro.turns[1].tool_call == 0
    assert ro.policy_versions == [0] and ro.policy_version == 0  # the engine's version wins
    assert ro.engine == "scripted-0" and ro.timing.tool_wait_s >= 0.01
    ro.check()
    back = from_json(to_json(ro), Rollout)
    assert back == ro


async def test_malformed_json_is_answered_with_an_error(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    bad = '<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": </tool_call>'
    eng = ScriptedEngine(_ids(tok, bad, "ok <|im_end|>"), tok)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok), PROMPT)
    assert tool.calls == []
    call = ro.tool_calls[0]
    assert call.status == ToolStatus.MALFORMED and "JSON" in call.error
    tool_text = tok.decode(ro.response_ids[ro.turns[1].start:ro.turns[1].end])
    assert "not valid JSON" in tool_text
    assert ro.status == RolloutStatus.COMPLETED and len(eng.requests) == 2  # it went on


async def test_unknown_tool_and_bad_arguments_are_malformed(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    unknown = '<tool_call>{"name": "web_search", "arguments": {"q": "x"}}</tool_call>'
    noarg = '<tool_call>{"name": "lookup", "arguments": {"wrong": 1}}</tool_call>'

    async def lookup(key: str) -> str:
        return f"value of {key}"

    ft = FunctionTool(lookup, {"type": "function", "function": {"name": "lookup"}})
    eng = ScriptedEngine(_ids(tok, unknown, noarg, "<|im_end|>"), tok)
    ro = await run_rollout(eng, tok, [ft], _settings(tok), PROMPT)
    assert [c.status for c in ro.tool_calls] == [ToolStatus.MALFORMED, ToolStatus.MALFORMED]
    assert "unknown tool 'web_search'" in ro.tool_calls[0].error
    assert "lookup" in ro.tool_calls[1].error
    assert ro.status == RolloutStatus.COMPLETED


async def test_a_raising_tool_is_a_sandbox_failure_not_a_crash(tiny_tokenizer) -> None:
    tok = tiny_tokenizer

    class Broken(EvalTool):
        async def __call__(self, arguments):
            raise RuntimeError("worker died")

    eng = ScriptedEngine(_ids(tok, CALL, "<|im_end|>"), tok)
    ro = await run_rollout(eng, tok, [Broken()], _settings(tok), PROMPT)
    assert ro.tool_calls[0].status == ToolStatus.SANDBOX_FAILURE
    assert "worker died" in ro.tool_calls[0].error
    assert ro.status == RolloutStatus.COMPLETED


async def test_max_turns_stops_without_running_the_last_call(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, CALL, CALL, CALL, ANSWER), tok)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok, max_turns=2), PROMPT)
    assert ro.status == RolloutStatus.TRUNCATED and ro.stop_reason == StopReason.MAX_TURNS
    assert len(tool.calls) == 1 and len(eng.requests) == 2
    assert [t.role for t in ro.turns] == ["assistant", "tool", "assistant"]
    ro.check()


async def test_budget_truncates_mid_turn(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "thinking " * 50 + CALL), tok)
    ro = await run_rollout(eng, tok, [EvalTool()], _settings(tok, max_response_tokens=20), PROMPT)
    assert ro.status == RolloutStatus.TRUNCATED and ro.stop_reason == StopReason.BUDGET
    assert len(ro.response_ids) == 20 and eng.requests[0].sampling.max_new_tokens == 20
    assert ro.tool_calls == []


async def test_budget_is_shared_by_tool_output_and_later_turns(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, CALL, "more " * 400), tok)
    ro = await run_rollout(eng, tok, [EvalTool()], _settings(tok, max_response_tokens=120), PROMPT)
    used = ro.turns[1].end
    assert eng.requests[1].sampling.max_new_tokens == 120 - used
    assert ro.stop_reason == StopReason.BUDGET and len(ro.response_ids) == 120


async def test_an_engine_length_limit_short_of_the_budget_truncates(tiny_tokenizer) -> None:
    # the server's context window, not the response budget, ends the second turn (and cuts
    # off a call that never closes): truncated, nothing run, the budget left unspent
    tok = tiny_tokenizer
    prompt_len = len(tok.encode(PROMPT))
    first = _ids(tok, CALL)[0]
    eng = ScriptedEngine(_ids(tok, CALL, "more " * 40 + CALL), tok,
                         context_window=prompt_len + len(first) + 80)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok, max_response_tokens=1000), PROMPT)
    assert ro.status == RolloutStatus.TRUNCATED and ro.stop_reason == StopReason.BUDGET
    assert len(tool.calls) == 1 and len(ro.tool_calls) == 1
    assert len(eng.requests) == 2 and eng.requests[1].sampling.max_new_tokens > 500
    assert prompt_len + len(ro.response_ids) == prompt_len + len(first) + 80 < prompt_len + 1000
    assert ro.response_text == tok.decode(ro.response_ids)
    ro.check()


async def test_an_observation_that_would_not_fit_is_named_as_one(tiny_tokenizer) -> None:
    """Issue 54 L5: a text environment's long observation ended the rollout as
    `tool_output_overflow`, though no tool was involved."""
    from asyncrl.rollout.agent import AgentLoop

    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "I guess 5<|im_end|>", ANSWER), tok)
    turn_len = len(tok.encode("I guess 5<|im_end|>"))

    async def env(ro, turn_text: str) -> str | None:
        return "Higher. " * 60  # an observation longer than what is left of the budget

    agent = AgentLoop(tok, [], _settings(tok, max_response_tokens=turn_len + 40), env=env)
    ro = agent.new_rollout(PROMPT, rollout_id="r0", prompt_id="", group_id="")
    await agent.advance(ro, eng)
    assert ro.stop_reason == StopReason.OBSERVATION_OVERFLOW
    assert ro.status == RolloutStatus.TRUNCATED and not ro.tool_calls


async def test_tool_output_that_would_not_fit_stops_the_rollout(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, CALL, ANSWER), tok)
    call_len = len(tok.encode(CALL))
    tool = EvalTool(output="9" * 250)
    ro = await run_rollout(eng, tok, [tool], _settings(tok, max_response_tokens=call_len + 40),
                           PROMPT)
    assert ro.stop_reason == StopReason.TOOL_OUTPUT_OVERFLOW and ro.status == RolloutStatus.TRUNCATED
    assert len(ro.tool_calls) == 1 and len(ro.response_ids) == call_len  # output not appended
    assert len(eng.requests) == 1


async def test_a_turn_without_a_call_completes(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "The answer is \\boxed{3}."), tok)
    ro = await run_rollout(eng, tok, [EvalTool()], _settings(tok), PROMPT)
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.NO_TOOL_CALL


async def test_markdown_format(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    md_prompt = formats.render_prompt("What is 6*7?", formats.MARKDOWN, [formats.PYTHON_TOOL_SCHEMA])
    eng = ScriptedEngine(_ids(tok, "Compute:\n```python\nprint(6*7)\n```\n", ANSWER), tok)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok, tool_format=formats.MARKDOWN), md_prompt)
    assert eng.requests[0].sampling.stop_strings == formats.MARKDOWN.stop_strings
    assert tool.calls == [{"code": "print(6*7)\n", "input": ""}]
    tool_text = tok.decode(ro.response_ids[ro.turns[1].start:ro.turns[1].end])
    assert tool_text.startswith("```output\n") and "42" in tool_text
    assert ro.status == RolloutStatus.COMPLETED


async def test_markdown_fences_that_are_not_python_calls_continue_the_turn(tiny_tokenizer) -> None:
    """A bare opening fence and a closed non-Python block stop the engine (the stop string is
    the fence's end) but are text: the turn goes on in a new request with the whole context,
    and only the Python block is run. An engine lost during such a continuation takes the
    whole turn back, as for one request."""
    tok = tiny_tokenizer
    md_prompt = formats.render_prompt("What is 6*7?", formats.MARKDOWN, [formats.PYTHON_TOOL_SCHEMA])
    first = "Say:\n```\nhi\n```\nNow:\n```python\nprint(6*7)\n```\n"
    eng = ScriptedEngine(_ids(tok, first, ANSWER), tok)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok, tool_format=formats.MARKDOWN), md_prompt)
    assert tool.calls == [{"code": "print(6*7)\n", "input": ""}]
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.EOS
    assert [t.role for t in ro.turns] == ["assistant", "tool", "assistant"]
    assert tok.decode(ro.response_ids[:ro.turns[0].end]) == first
    assert len(eng.requests) == 4  # the bare fence's open and close, the call, the answer
    assert eng.requests[1].input_ids == ro.prompt_ids + tok.encode("Say:\n```\n")
    ro.check()

    lost = ScriptedEngine(_ids(tok, first, ANSWER), tok, fail_after_tokens=len(tok.encode(
        "Say:\n```\nhi\n")))
    agent = AgentLoop(tok, [EvalTool()], _settings(tok, tool_format=formats.MARKDOWN))
    ro = agent.new_rollout(md_prompt, rollout_id="r8")
    with pytest.raises(EngineUnavailable):
        await agent.advance(ro, lost)
    assert ro.response_ids == [] and ro.turns == [] and ro.loss_mask == []


async def test_engine_error_is_recorded_not_raised(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "x" * 30 + CALL, ANSWER), tok, error_after_tokens=5)
    ro = await run_rollout(eng, tok, [EvalTool()], _settings(tok), PROMPT)
    assert ro.status == RolloutStatus.FAILED and ro.stop_reason == StopReason.ERROR
    assert "request failed" in ro.error
    ro.check()


async def test_unavailable_engine_rolls_back_to_the_last_completed_turn(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    turns = _ids(tok, CALL, "a long second turn " * 5 + CALL, ANSWER)
    first_len = len(turns[0])
    eng = ScriptedEngine(turns, tok, fail_after_tokens=first_len + 10)
    agent = AgentLoop(tok, [EvalTool()], _settings(tok))
    ro = agent.new_rollout(PROMPT, rollout_id="r9")
    with pytest.raises(EngineUnavailable):
        await agent.advance(ro, eng)
    # the partial second turn is gone; the first turn and its tool output remain
    assert [t.role for t in ro.turns] == ["assistant", "tool"]
    assert len(ro.response_ids) == ro.turns[1].end == len(ro.loss_mask) == len(ro.logprobs)
    # resume on another engine: it picks up at turn 2 and finishes
    other = ScriptedEngine(turns, tok, name="scripted-1")
    await agent.advance(ro, other)
    assert ro.status == RolloutStatus.COMPLETED and ro.engine == "scripted-1"
    assert ro.response_text == tok.decode(ro.response_ids)  # the rolled-back text is gone too
    assert len(ro.tool_calls) == 2 and other.requests[0].input_ids == ro.prompt_ids + ro.response_ids[: ro.turns[1].end]
    ro.check()


async def test_an_engine_that_stops_answering_times_out(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, "x" * 20 + CALL), tok, hang_after_tokens=3)
    agent = AgentLoop(tok, [EvalTool()], _settings(tok, stall_timeout_s=0.2))
    ro = agent.new_rollout(PROMPT, rollout_id="r")
    with pytest.raises(EngineUnavailable, match="no token"):
        await asyncio.wait_for(agent.advance(ro, eng), 5)
    assert ro.response_ids == [] and ro.logprobs == []
    ro2 = await run_rollout(eng, tok, [], _settings(tok, stall_timeout_s=0.2), PROMPT)
    assert ro2.status == RolloutStatus.FAILED and "unavailable" in ro2.error


async def test_without_tools_no_stop_strings_are_sent(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_ids(tok, CALL + " more <|im_end|>"), tok)
    ro = await run_rollout(eng, tok, [], _settings(tok), formats.render_prompt("q", formats.HERMES, None))
    assert eng.requests[0].sampling.stop_strings == ()
    assert ro.tool_calls == [] and ro.stop_reason == StopReason.EOS


def test_settings_validate() -> None:
    with pytest.raises(ValueError):
        RolloutSettings(max_response_tokens=0)
    s = RolloutSettings()
    assert s.tool_format is formats.HERMES and s.max_turns == 5
    json.dumps(s.stop_token_ids)


async def test_a_call_closing_a_long_turn_is_parsed(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    long_turn = "thinking about it " * 200 + CALL
    assert len(tok.encode(long_turn)) > 600
    eng = ScriptedEngine(_ids(tok, long_turn, ANSWER), tok)
    tool = EvalTool()
    ro = await run_rollout(eng, tok, [tool], _settings(tok, max_response_tokens=4096), PROMPT)
    assert tool.calls == [{"code": "print(6*7)", "input": ""}]
    # the turn is parsed as a whole (formats' contract): a stray opener far back makes the
    # call malformed, exactly as `HERMES.parse` of the full turn text says
    stray = "<tool_call> oops " + "x " * 400 + CALL
    assert isinstance(formats.HERMES.parse(stray), formats.Malformed)
    eng = ScriptedEngine(_ids(tok, stray, ANSWER), tok)
    ro = await run_rollout(eng, tok, [tool], _settings(tok, max_response_tokens=4096), PROMPT)
    assert ro.tool_calls[0].status == ToolStatus.MALFORMED


async def test_a_request_queued_behind_a_full_batch_is_not_a_stall(tiny_tokenizer,
                                                                  tiny_model_factory) -> None:
    """A real local engine running one request at a time: the last of six waits several stall
    timeouts in its queue while the engine answers the others, and still completes."""
    from asyncrl.engine.local import LocalEngine

    tok = tiny_tokenizer
    st = _settings(tok, stall_timeout_s=0.3, max_response_tokens=120, max_turns=1)
    async with LocalEngine(tiny_model_factory(0), tok, kv_token_budget=8192,
                           max_running=1) as eng:
        async def one(i: int) -> Rollout:
            await asyncio.sleep(0.01 * i)  # arrival order: a queue of five behind the first
            return await run_rollout(eng, tok, [], st, PROMPT, rollout_id=f"r{i}")

        t0 = asyncio.get_running_loop().time()
        # a guard against a hang, not a speed bar: 2,400 tokens one at a time took over 60 s
        # on a loaded 2-core machine (720 now)
        ros = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 240)
        waited = asyncio.get_running_loop().time() - t0
    assert waited > 2 * st.stall_timeout_s  # the last one sat queued longer than a stall
    assert [r.error for r in ros] == [""] * 6  # before: the queued ones "no token for 0s"
    assert all(r.status != RolloutStatus.FAILED and len(r.response_ids) == 120 for r in ros)
