"""The agent loop and `PythonTool` against the real local sandbox pool.

A scripted policy writes the tool calls; the real pool runs them. Checks: the call runs before
the stream continues and its output comes back as masked tokens; statuses map through; bad
arguments and malformed JSON are answered with errors; limits stop the rollout; records
serialize.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from fakes.scripted_engine import ScriptedEngine

from asyncrl import formats
from asyncrl.errors import ToolCallError
from asyncrl.records import Rollout, RolloutStatus, StopReason, ToolStatus, from_json, to_json
from asyncrl.rollout import PythonTool, RolloutSettings, run_rollout

sandbox = pytest.importorskip("sandbox")
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    cfg = sandbox.PoolConfig(workers=2, isolation="auto", time_limit_s=4.0)
    async with sandbox.SandboxPool(cfg) as pool:
        wrap = getattr(sandbox, "LocalSandboxClient", None)
        if wrap is None:  # the pool itself has the client's execute()
            yield pool
        else:
            async with wrap(pool) as c:
                yield c


def _call(code: str, stdin: str = "") -> str:
    return formats.HERMES.render_call(code, stdin)


def _settings(tok, **kw) -> RolloutSettings:
    return RolloutSettings(max_response_tokens=kw.pop("max_response_tokens", 1024), temperature=0.0,
                           stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),), **kw)


PROMPT = formats.render_prompt("Sum the input.", formats.HERMES, [formats.PYTHON_TOOL_SCHEMA])


async def test_python_tool_maps_sandbox_outcomes(client) -> None:
    tool = PythonTool(client, time_limit_s=1.0, max_output_chars=64)
    ok = await tool({"code": "import sys; print(sum(map(int, sys.stdin.read().split())))",
                     "input": "1 2 3 4"})
    assert ok.status == ToolStatus.OK and ok.stdout.strip() == "10"
    assert ok.output.startswith("Execution succeeded.") and "10" in ok.output
    err = await tool({"code": "1/0"})
    assert err.status == ToolStatus.ERROR and "division by zero" in err.output
    assert "ZeroDivisionError" in err.stderr  # full text kept on the record, cut for the model
    slow = await tool({"code": "while True: pass"})
    assert slow.status == ToolStatus.TIMEOUT
    big = await tool({"code": "print('x' * 5000)"})
    assert big.status == ToolStatus.OK and len(big.output) < 200 and "characters cut" in big.output
    with pytest.raises(ToolCallError):
        await tool({"input": "no code"})


async def test_rollout_with_the_real_pool(client, tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    turns = [tok.encode("Let me add them. " + _call("import sys; print(sum(map(int, sys.stdin.read().split())))", "20 22")),
             tok.encode('<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": </tool_call>'),
             tok.encode(_call("1/0")),
             tok.encode("<answer>\\boxed{42}</answer><|im_end|>")]
    eng = ScriptedEngine(turns, tok)
    ro = await run_rollout(eng, tok, [PythonTool(client)], _settings(tok), PROMPT, rollout_id="real")
    assert ro.status == RolloutStatus.COMPLETED and ro.stop_reason == StopReason.EOS
    assert [c.status for c in ro.tool_calls] == [ToolStatus.OK, ToolStatus.MALFORMED, ToolStatus.ERROR]
    assert ro.tool_calls[0].stdout == "42\n" and ro.tool_calls[0].duration_s > 0
    assert "not valid JSON" in ro.tool_calls[1].output
    # each later request already holds the previous tool output (the tool ran in between)
    assert len(eng.requests) == 4
    first_tool = ro.turns[1]
    assert first_tool.role == "tool"
    tool_text = tok.decode(ro.response_ids[first_tool.start:first_tool.end])
    assert "42" in tool_text and "<tool_response>" in tool_text
    assert eng.requests[1].input_ids == ro.prompt_ids + ro.response_ids[:first_tool.end]
    for t in ro.turns:
        mask = set(ro.loss_mask[t.start:t.end])
        assert mask == ({0} if t.role == "tool" else {1})
    ro.check()
    assert from_json(to_json(ro), Rollout) == ro


async def test_limits_with_the_real_pool(client, tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    call = tok.encode(_call("print(1)"))
    eng = ScriptedEngine([call, call, call, call], tok)
    ro = await run_rollout(eng, tok, [PythonTool(client)], _settings(tok, max_turns=3), PROMPT)
    assert ro.stop_reason == StopReason.MAX_TURNS and len(ro.tool_calls) == 2
    eng = ScriptedEngine([tok.encode(_call("print('y' * 3000)")), call], tok)
    ro = await run_rollout(eng, tok, [PythonTool(client, max_output_chars=2000)],
                           _settings(tok, max_response_tokens=len(call) + 200), PROMPT)
    assert ro.stop_reason == StopReason.TOOL_OUTPUT_OVERFLOW and ro.status == RolloutStatus.TRUNCATED
