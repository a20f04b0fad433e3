"""A task written for another RL project runs in asyncrl's loop: plain functions become tools
with OpenAI schemas, and a verifiers-style environment (dataset, rubric, tools, system prompt)
becomes problems, tools and one reward."""

from __future__ import annotations

import json

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl.adapters import from_environment, function_tool, rubric_reward
from asyncrl.api import Problem, RolloutSettings, rollouts
from asyncrl.errors import ToolCallError
from asyncrl.records import Rollout


def lookup_population(city: str, year: int = 2020) -> str:
    """Population of a city in a year.

    Longer text that is not part of the description."""
    return {"paris": "2148000"}.get(city.lower(), "unknown")


async def test_a_plain_function_becomes_a_tool_with_an_openai_schema() -> None:
    tool = function_tool(lookup_population)
    assert tool.schema == {"type": "function", "function": {
        "name": "lookup_population", "description": "Population of a city in a year.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "year": {"type": "integer"}}}}}
    out = await tool({"city": "Paris"})
    assert (out.status.value, out.output) == ("ok", "2148000")
    with pytest.raises(ToolCallError, match="lookup_population"):
        await tool({"town": "Paris"})


class _Rubric:  # verifiers.Rubric's shape: funcs and weights
    def __init__(self, funcs, weights) -> None:
        self.funcs, self.weights = funcs, weights


class _Env:  # verifiers.ToolEnv's shape: dataset, rubric, tools, system_prompt
    def __init__(self) -> None:
        def correct(completion, answer) -> float:
            return 1.0 if answer in completion[-1]["content"] else 0.0

        async def used_tool(state, **kwargs) -> float:
            return 1.0 if state["rollout"].tool_calls else 0.0

        self.dataset = [{"prompt": [{"role": "system", "content": "ignored"},
                                    {"role": "user", "content": "How many people live in Paris?"}],
                         "answer": "2148000", "task": "geo"}]
        self.rubric = _Rubric([correct, used_tool], [1.0, 0.5])
        self.tools = [lookup_population]
        self.system_prompt = "Use the tools."


async def test_a_verifiers_style_environment_runs_in_the_rollout_loop(tiny_tokenizer,
                                                                       caplog) -> None:
    tok = tiny_tokenizer
    task = from_environment(_Env())
    assert task.problems == [Problem(id="row-0", question="How many people live in Paris?",
                                     answer="2148000", source="geo")]
    assert [t.name for t in task.tools] == ["lookup_population"]
    call = ("<tool_call>" + json.dumps({"name": "lookup_population",
                                        "arguments": {"city": "Paris"}}) + "</tool_call>")
    eng = ScriptedEngine([tok.encode(call), tok.encode("<answer>2148000</answer><|im_end|>")],
                         tok)
    settings = RolloutSettings(max_response_tokens=200)
    (ro,) = [r async for r in rollouts(task.problems, engines=[eng], tokenizer=tok,
                                       tools=task.tools, reward_fn=task.reward_fn,
                                       settings=settings)]
    assert [c.status.value for c in ro.tool_calls] == ["ok"]
    assert "2148000" in ro.response_text
    assert (ro.reward, ro.reward_status) == (1.5, "ok")
    assert "lookup_population" in tok.decode(eng.requests[0].input_ids)  # its schema is offered
    # the environment's own system text replaces the built-in one, tool list included: said
    eng = ScriptedEngine([tok.encode("<answer>2148000</answer><|im_end|>")], tok)
    from asyncrl.log import use_host_logging

    use_host_logging()  # embedded logging, whatever an earlier test configured
    with caplog.at_level("WARNING", logger="asyncrl"):
        (ro,) = [r async for r in rollouts(task.problems, engines=[eng], tokenizer=tok,
                                           tools=task.tools, reward_fn=task.reward_fn,
                                           system_prompt=task.system_prompt, settings=settings)]
    assert tok.decode(eng.requests[0].input_ids).startswith("<|im_start|>system\nUse the tools.")
    assert any("tools_not_in_system_prompt" in r.getMessage() for r in caplog.records)


async def test_a_rubric_needs_as_many_weights_as_functions() -> None:
    with pytest.raises(ValueError, match="2 functions but 1 weights"):
        rubric_reward([lambda answer: 1.0, lambda answer: 0.0], [1.0])
    reward = rubric_reward([lambda prompt, answer: float(answer in prompt)])
    ro = Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=0, prompt_ids=[])
    res = await reward(Problem(id="p", question="is it 7?", answer="7"), ro)
    assert (res.reward, res.status) == (1.0, "ok")
