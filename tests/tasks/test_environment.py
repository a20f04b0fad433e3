"""A task written for another RL project runs in asyncrl's loop: plain functions become tools
with OpenAI schemas, a real verifiers 0.4 taskset becomes problems, tools and verifiers' own
scoring, and plain reward functions become one reward, each isolated."""

from __future__ import annotations

import json
from typing import Literal, Optional

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl.api import (
    Problem,
    RolloutSettings,
    from_environment,
    function_tool,
    rollouts,
    rubric_reward,
)
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


async def test_a_verifiers_taskset_runs_in_the_rollout_loop(tiny_tokenizer) -> None:
    """A real verifiers 0.4 taskset (the example under examples/), not a look-alike: its
    tool is offered and called, and verifiers' own scoring gives the reward."""
    from examples.verifiers_arith.arith_env import ArithConfig, ArithTaskset

    tok = tiny_tokenizer
    task = from_environment(ArithTaskset(ArithConfig(size=3)), tokenizer=tok)
    assert len(task.problems) == 3 and task.system_prompt.startswith("Multiply.")
    assert [t.name for t in task.tools] == ["multiply"]
    p = next(p for p in task.problems if p.id == "mul-0")
    a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" times "))
    call = ("<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
            + "</tool_call>")
    eng = ScriptedEngine([tok.encode(call), tok.encode(f"\\boxed{{{a * b}}}<|im_end|>")], tok)
    (ro,) = [r async for r in rollouts([p], engines=[eng], tokenizer=tok, tools=task.tools,
                                       reward_fn=task.reward_fn,
                                       settings=RolloutSettings(max_response_tokens=200))]
    assert [(c.name, c.status.value) for c in ro.tool_calls] == [("multiply", "ok")]
    assert (ro.reward, ro.reward_detail) == (1.0, {"correct": 1.0, "used_calculator": 1.0})
    assert "multiply" in tok.decode(eng.requests[0].input_ids)  # its schema is offered


async def test_rubric_functions_are_isolated_one_raising_scores_zero(tiny_tokenizer) -> None:
    def correct(completion, answer) -> float:
        return 1.0 if answer in completion[-1]["content"] else 0.0

    async def used_tool(state, **kwargs) -> float:
        return 1.0 if state["rollout"].tool_calls else 0.0

    def needs_trajectory(state) -> float:  # a verifiers monitor metric: no such key here
        return float(len(state["trajectory"]))

    reward = rubric_reward([correct, used_tool, needs_trajectory], [1.0, 0.5, 0.0])
    ro = Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=0, prompt_ids=[],
                 response_text="<answer>2148000</answer>")
    res = await reward(Problem(id="p", question="Paris?", answer="2148000"), ro)
    assert (res.reward, res.status) == (1.0, "ok")
    assert res.detail == {"correct": 1.0, "used_tool": 0.0, "needs_trajectory": 0.0}
    assert res.errors == ["needs_trajectory: KeyError: 'trajectory'"]


async def test_a_rubric_needs_as_many_weights_as_functions() -> None:
    with pytest.raises(ValueError, match="2 functions but 1 weights"):
        rubric_reward([lambda answer: 1.0, lambda answer: 0.0], [1.0])
    reward = rubric_reward([lambda prompt, answer: float(answer in prompt)])
    ro = Rollout(rollout_id="r", prompt_id="p", group_id="g", policy_version=0, prompt_ids=[])
    res = await reward(Problem(id="p", question="is it 7?", answer="7"), ro)
    assert (res.reward, res.status) == (1.0, "ok")


def forecast(city: str, days: int | None = None, scale: Optional[float] = None,  # noqa: UP045
             hours: list[int] | None = None, unit: Literal["c", "f"] = "c") -> str:
    """Forecast."""
    return f"{city} {days} {scale} {hours} {unit}"


def test_optional_and_generic_parameters_keep_their_json_types() -> None:
    """G14: `int | None` and `Optional[float]` were declared strings, so the model was told to
    pass "3" where the function wants 3."""
    props = function_tool(forecast).schema["function"]["parameters"]["properties"]
    assert props == {"city": {"type": "string"}, "days": {"type": "integer"},
                     "scale": {"type": "number"},
                     "hours": {"type": "array", "items": {"type": "integer"}},
                     "unit": {"type": "string", "enum": ["c", "f"]}}


async def test_an_in_process_tool_past_its_deadline_is_a_timeout_with_the_runs_key() -> None:
    """Issue 54 L8: a hung in-process tool was `sandbox_failure` (no sandbox is involved) and
    its 30 s deadline had no key; now it is `timeout`, at `rollout.tool_timeout_s` when the
    task's tools are built for a run (`TaskContext.tool_timeout_s`)."""
    import asyncio

    from asyncrl.records import ToolStatus
    from asyncrl.tasks.task import TaskContext
    from asyncrl.tasks.wiring import _as_tools

    async def slow(n: int) -> str:
        """Never answers in time."""
        await asyncio.sleep(30)
        return str(n)

    (tool,) = _as_tools(slow, "mine:slow", TaskContext(tool_timeout_s=0.2))
    assert tool.timeout_s == 0.2
    out = await tool({"n": 3})
    assert out.status == ToolStatus.TIMEOUT and "within 0.2s" in out.error

    def broken(n: int) -> str:
        """Raises."""
        raise RuntimeError("the tool's own bug")

    (bad,) = _as_tools(broken, "mine:broken", TaskContext())
    assert (await bad({"n": 1})).status == ToolStatus.SANDBOX_FAILURE
