"""The group runner and scheduler shell: groups stream as they finish, failures stay local,
engine death loses no rollout, KV capacity bounds concurrency."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl import exact_match_reward, formats
from asyncrl.records import Group, Problem, RewardResult, RolloutStatus, StopReason, ToolStatus
from asyncrl.rollout import RolloutRunner, RolloutSettings, ToolOutcome

CALL = '<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": "print(6*7)"}}</tool_call>'
RIGHT = "<answer>\\boxed{42}</answer><|im_end|>"
WRONG = "<answer>\\boxed{41}</answer><|im_end|>"


class SixSevenTool:
    name = formats.PYTHON_TOOL
    schema = formats.PYTHON_TOOL_SCHEMA

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, arguments: dict) -> ToolOutcome:
        self.calls += 1
        await asyncio.sleep(0.002)
        return ToolOutcome(status=ToolStatus.OK, output="Execution succeeded.\n42\nTime: 0.00s",
                           stdout="42\n")


def _settings(tok, **kw) -> RolloutSettings:
    return RolloutSettings(max_response_tokens=kw.pop("max_response_tokens", 256),
                           temperature=kw.pop("temperature", 0.0),
                           stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),), **kw)


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", question=f"What is 6*7? ({i})", answer="42") for i in range(n)]


def _script(tok, answer_for=lambda rid: RIGHT):
    call, = [tok.encode(CALL)]

    def script(rid: str):
        return [call, tok.encode("thinking " * 3 + CALL), tok.encode(answer_for(rid))]

    return script


async def _collect(runner, problems, n, settings, version=0) -> list[Group]:
    return [g async for g in runner.run(problems, n, settings, version)]


async def test_groups_are_complete_rewarded_and_records_are_sane(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    wrong_one = lambda rid: WRONG if rid.endswith(":1") else RIGHT  # noqa: E731
    eng = ScriptedEngine(_script(tok, wrong_one), tok)
    tool = SixSevenTool()
    runner = RolloutRunner([eng], tok, [tool], exact_match_reward)
    groups = await _collect(runner, _problems(3), 4, _settings(tok), version=7)
    assert sorted(g.problem.id for g in groups) == ["p0", "p1", "p2"]
    assert len({g.group_id for g in groups}) == 3
    for g in groups:
        assert len(g.rollouts) == 4
        assert [r.reward for r in g.rollouts] == [1.0, 0.0, 1.0, 1.0]
        assert all(r.reward_status == "ok" for r in g.rollouts)
        assert g.rollouts[1].answer == "41"
        for r in g.rollouts:
            r.check()
            assert r.group_id == g.group_id and r.prompt_id == g.problem.id
            assert r.status == RolloutStatus.COMPLETED and r.stop_reason == StopReason.EOS
            assert len(r.tool_calls) == 2 and r.engine == "scripted-0"
            assert r.policy_versions == [0]
            assert r.timing.total_s >= r.timing.tool_wait_s > 0
    assert tool.calls == 3 * 4 * 2
    # the prompt lists the tool schema and was tokenized once per problem
    prompt = tok.decode(groups[0].rollouts[0].prompt_ids)
    assert formats.PYTHON_TOOL in prompt and prompt.endswith("<|im_start|>assistant\n")


async def test_a_group_is_yielded_as_soon_as_it_completes(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    def slow_script(rid: str):
        return [tok.encode("slow " * 40 + RIGHT)] if rid.startswith("slow") else _script(tok)(rid)

    eng = ScriptedEngine(slow_script, tok, delay_s=0.01, chunk=1, name="eng")
    runner = RolloutRunner([eng], tok, [SixSevenTool()], exact_match_reward)
    problems = [Problem(id="slow", question="q", answer="42"), Problem(id="quick", question="q", answer="42")]
    order = []
    async for g in runner.run(problems, 2, _settings(tok), 0):
        running = [r for r in eng._active if r.startswith("slow")]
        order.append((g.problem.id, len(running)))
    assert order[0][0] == "quick" and order[0][1] > 0  # slow group still streaming: no barrier
    assert order[1][0] == "slow"


async def test_reward_errors_are_recorded_not_raised(tiny_tokenizer) -> None:
    tok = tiny_tokenizer

    async def flaky(problem, rollout):
        if rollout.rollout_id.endswith(":0"):
            raise RuntimeError("verifier crashed")
        if rollout.rollout_id.endswith(":1"):
            await asyncio.sleep(10)
        return RewardResult(reward=1.0, status="ok", answer="42")

    runner = RolloutRunner([ScriptedEngine(_script(tok), tok)], tok, [SixSevenTool()], flaky,
                           reward_timeout_s=0.2)
    (g,) = await _collect(runner, _problems(1), 3, _settings(tok))
    assert [(r.reward, r.reward_status) for r in g.rollouts] == [
        (0.0, "reward_error"), (0.0, "reward_timeout"), (1.0, "ok")]


@pytest.mark.parametrize("policy", ["kv", "least_requests", "static"])
async def test_engine_death_mid_rollout_loses_no_rollout(tiny_tokenizer, policy) -> None:
    tok = tiny_tokenizer
    dying = ScriptedEngine(_script(tok), tok, name="dying", fail_after_tokens=150, delay_s=0.001)
    healthy = ScriptedEngine(_script(tok), tok, name="healthy", delay_s=0.001)
    tool = SixSevenTool()
    runner = RolloutRunner([dying, healthy], tok, [tool], exact_match_reward, policy=policy)
    groups = await asyncio.wait_for(_collect(runner, _problems(4), 4, _settings(tok)), 60)
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 16 and len(groups) == 4
    assert all(r.status == RolloutStatus.COMPLETED and r.reward == 1.0 for r in rollouts)
    sched = runner.last_scheduler
    assert sched.failed_engines == ["dying"] and sched.requeues > 0
    assert all(r.engine == "healthy" for r in rollouts if r.engine)
    # resumed from the last completed turn: no tool call was run twice for the record
    assert all(len(r.tool_calls) == 2 for r in rollouts)
    for r in rollouts:
        r.check()
        assert tok.decode(r.response_ids).count("<tool_response>") == 2


async def test_an_engine_that_stops_answering_is_taken_out(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    hung = ScriptedEngine(_script(tok), tok, name="hung", hang_after_tokens=40)
    ok = ScriptedEngine(_script(tok), tok, name="ok")
    runner = RolloutRunner([hung, ok], tok, [SixSevenTool()], exact_match_reward)
    groups = await asyncio.wait_for(
        _collect(runner, _problems(2), 2, _settings(tok, stall_timeout_s=0.3)), 30)
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(r.status == RolloutStatus.COMPLETED for r in rollouts)
    assert runner.last_scheduler.failed_engines == ["hung"]


async def test_when_every_engine_is_gone_rollouts_fail_but_groups_arrive(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_script(tok), tok, fail_after_tokens=10)
    runner = RolloutRunner([eng], tok, [SixSevenTool()], exact_match_reward)
    groups = await asyncio.wait_for(_collect(runner, _problems(2), 3, _settings(tok)), 30)
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 6
    assert all(r.status == RolloutStatus.FAILED and r.reward == 0.0 for r in rollouts)
    assert all("engine" in r.error for r in rollouts)


async def test_kv_capacity_bounds_concurrency(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    settings = _settings(tok, max_response_tokens=100)
    prompt_len = len(RolloutRunner([ScriptedEngine([], tok)], tok, [SixSevenTool()],
                                   exact_match_reward).prompt_ids(_problems(1)[0], settings))
    cap = 3 * (prompt_len + 100) + 5  # three worst-case reservations
    peak = 0

    class Counting(ScriptedEngine):
        async def stream(self, request):
            nonlocal peak
            async for d in super().stream(request):
                peak = max(peak, len({k.rsplit("/", 2)[0] for k in self._active}))
                yield d

    eng = Counting(_script(tok), tok, capacity=cap, delay_s=0.001)
    runner = RolloutRunner([eng], tok, [SixSevenTool()], exact_match_reward, policy="least_requests")
    groups = await _collect(runner, _problems(3), 4, settings)
    assert sum(len(g.rollouts) for g in groups) == 12
    assert peak == 3


async def test_leaving_early_cancels_the_rest_cleanly(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    eng = ScriptedEngine(_script(tok), tok, delay_s=0.002)
    runner = RolloutRunner([eng], tok, [SixSevenTool()], exact_match_reward)
    async with contextlib.aclosing(runner.run(_problems(5), 2, _settings(tok), 0)) as it:
        async for _g in it:
            break
    await asyncio.sleep(0.05)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not [t for t in others if t.get_name().startswith("rollout-")]
    assert not eng._active


async def test_runner_on_the_local_engine(tiny_model_factory, tiny_tokenizer) -> None:
    import torch

    from asyncrl.engine.local.engine import LocalEngine

    torch.set_num_threads(1)
    tok = tiny_tokenizer
    settings = _settings(tok, max_response_tokens=24, temperature=1.0, seed=3)
    async with LocalEngine(tiny_model_factory(0), tok, kv_token_budget=4096, max_running=8) as eng:
        runner = RolloutRunner([eng], tok, [SixSevenTool()], exact_match_reward)
        groups = await _collect(runner, _problems(2), 3, settings, version=0)
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 6
    for r in rollouts:
        r.check()
        assert r.engine == "local-0" and r.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)
        assert 0 < len(r.response_ids) <= 24 and all(lp <= 0 for lp in r.logprobs)
        assert r.reward_status in ("ok", "no_answer")


async def test_routine_collections_are_off_while_a_run_is_in_flight(tiny_tokenizer) -> None:
    import gc

    from asyncrl.rollout.eventloop import RUN_GC_BACKSTOP

    tok = tiny_tokenizer
    before = gc.get_threshold()
    seen = []

    async def reward(problem, rollout):
        seen.append(gc.get_threshold())
        return RewardResult(reward=0.0, status="ok")

    runner = RolloutRunner([ScriptedEngine(_script(tok), tok)], tok, [SixSevenTool()], reward)
    await _collect(runner, _problems(1), 2, _settings(tok))
    assert seen and all(t[0] >= RUN_GC_BACKSTOP and t[2] >= 1 << 30 for t in seen)
    assert gc.get_threshold() == before
    off = RolloutRunner([ScriptedEngine(_script(tok), tok)], tok, [SixSevenTool()], reward,
                        quiet_gc=False)
    seen.clear()
    await _collect(off, _problems(1), 1, _settings(tok))
    assert seen == [before]
