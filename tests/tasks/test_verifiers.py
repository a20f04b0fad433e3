"""A real verifiers 0.4 taskset (`verifiers.v1`) in asyncrl: its tasks are the problems, its
`@vf.tool`s the tools, and `Task.score` — verifiers' own code — the reward; a reward function
that raises scores 0 for itself and is counted, never failing the rollout."""

from __future__ import annotations

import json

import pytest
from fakes.scripted_engine import ScriptedEngine

from asyncrl.api import RolloutSettings, rollouts
from asyncrl.errors import ConfigError
from asyncrl.tasks.source import adapt
from asyncrl.tasks.task import TaskContext
from asyncrl.tasks.wiring import build_reward, build_tools

vf = pytest.importorskip("verifiers.v1")  # installed by dev: tests/test_dev_extras.py
from examples.verifiers_arith.arith_env import ArithTaskset  # noqa: E402 (imports verifiers)


class _Data(vf.TaskData):
    answer: str


class FlakyTask(vf.Task[_Data]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def broken(self, trace: vf.Trace) -> float:
        raise RuntimeError("this reward function has a bug")


class FlakyTaskset(vf.Taskset[FlakyTask, vf.TasksetConfig]):
    def load(self):
        return [FlakyTask(_Data(id="q0", prompt="What is 17 times 23?", answer="391"))]


def _call(name: str, **arguments: int) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


async def _one(tok, src, script, problem_index=0):
    ctx = TaskContext(tokenizer=tok)
    tools, reward = build_tools(["auto"], src, ctx), build_reward("auto", src, ctx)
    eng = ScriptedEngine([tok.encode(t) for t in script], tok)
    problems = (src.train + src.eval)[problem_index:problem_index + 1]
    (ro,) = [r async for r in rollouts(problems, engines=[eng], tokenizer=tok, tools=tools,
                                       reward_fn=reward,
                                       settings=RolloutSettings(max_response_tokens=300))]
    return problems[0], ro, eng


async def test_the_taskset_trains_on_its_tasks_tools_and_scoring(tiny_tokenizer) -> None:
    src = adapt(ArithTaskset, "arith", {"size": 20, "eval_size": 4, "config": {"size": 20}}, 0)
    assert (len(src.train), len(src.eval)) == (16, 4)
    assert src.system_prompt.startswith("Multiply.")
    tools = build_tools(["auto"], src, TaskContext(tokenizer=tiny_tokenizer))
    assert [t.name for t in tools] == ["multiply"]
    assert tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    p = src.train[0]
    a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" times "))
    _, ro, _ = await _one(tiny_tokenizer, src, [_call("multiply", a=a, b=b),
                                                  f"So \\boxed{{{a * b}}}<|im_end|>"])
    assert [(c.name, c.status.value, c.output) for c in ro.tool_calls] == [
        ("multiply", "ok", str(a * b))]
    # verifiers' verify_boxed_math_answer scored the last reply, its metric saw the tool
    assert (ro.reward, ro.reward_status) == (1.0, "ok")
    assert ro.reward_detail == {"correct": 1.0, "used_calculator": 1.0}
    _, wrong, _ = await _one(tiny_tokenizer, src, [f"\\boxed{{{a * b + 1}}}<|im_end|>"])
    assert (wrong.reward, wrong.reward_detail) == (0.0, {"correct": 0.0, "used_calculator": 0.0})


async def test_a_raising_reward_function_scores_zero_and_is_counted(tiny_tokenizer) -> None:
    src = adapt(FlakyTaskset, "flaky", {"eval_size": 0}, 0)
    _, ro, _ = await _one(tiny_tokenizer, src, ["It is 391.<|im_end|>"])
    assert (ro.status.value, ro.reward_status, ro.reward) == ("completed", "ok", 1.0)
    assert ro.reward_detail == {"correct": 1.0, "broken": 0.0}
    assert ro.reward_errors == ["broken: RuntimeError: this reward function has a bug"]


def test_a_bad_taskset_option_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.generator_options\.config: ArithTaskset"):
        adapt(ArithTaskset, "arith", {"config": {"sise": 3}}, 0)
    with pytest.raises(ConfigError, match="unknown option 'evalsize'"):
        adapt(ArithTaskset, "arith", {"evalsize": 3}, 0)


E2E_TASKSET = '''
import verifiers.v1 as vf


class Data(vf.TaskData):
    answer: str


class MulTask(vf.Task[Data]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.1)
    async def brevity(self, trace: vf.Trace) -> float:  # varies per sample: groups train
        return 1.0 / (1.0 + len(trace.last_reply))

    @vf.reward(weight=0.5)
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("bug in a reward function")


class Calc(vf.Toolset[vf.SharedToolsetConfig]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b


class Config(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class MulTaskset(vf.Taskset[MulTask, Config]):
    def load(self):
        return [MulTask(Data(id=f"m{a}x{b}", prompt=f"What is {a} times {b}?",
                             answer=str(a * b), system_prompt="Multiply."), self.config.task)
                for a in range(11, 15) for b in range(21, 24)]

    @classmethod
    def toolsets(cls, config):
        return [Calc(config.tools)]
'''


def test_asyncrl_train_runs_rl_steps_on_a_verifiers_taskset(tmp_path, monkeypatch) -> None:
    import sys

    from micro_config import (
        MICRO_MODEL,
        MICRO_RL_TAIL,
        ROOT,
        metric_rows,
        micro_rollout,
        run_ok,
        saved_rollouts,
    )

    (tmp_path / "mul_env.py").write_text(E2E_TASKSET)
    cfg = tmp_path / "vf.toml"
    cfg.write_text(MICRO_MODEL + """
[data]
train = "generator:mul_env:MulTaskset"
eval = "generator:mul_env:MulTaskset"
max_prompt_tokens = 400  # the Hermes tool prompt, in a 400-token vocabulary
[data.generator_options]
eval_size = 2
""" + micro_rollout(tool_format="hermes") + MICRO_RL_TAIL)
    run_dir = tmp_path / "run"
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir)], cwd=tmp_path, python_path=f"{ROOT}:{tmp_path}")
    steps = metric_rows(run_dir, "rl_step")
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["train/optimizer_step"] == 2.0  # both steps updated the policy
    rolls = saved_rollouts(run_dir)
    assert len(rolls) == 16
    for r in rolls:  # every reward is verifiers' weighted sum; the raising function counted
        d = r["reward_detail"]
        assert set(d) == {"correct", "brevity", "broken"} and d["broken"] == 0.0
        assert r["reward"] == pytest.approx(d["correct"] + 0.1 * d["brevity"])
        assert r["reward_errors"] == ["broken: ValueError: bug in a reward function"]
        assert r["reward_status"] == "ok"
    assert len({r["reward"] for r in rolls}) > 1
    assert metric_rows(run_dir, "eval")
    # counted like the built-in task's failures: per step, in the report and the viewer
    assert [r["rollout/reward_part_error_count"] for r in steps] == [8.0, 8.0]
    assert all(r["rollout/reward_part/broken"] == 0.0 for r in steps)
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "| reward parts that raised (that part scored 0) | 16 |" in summary
    viewer = (run_dir / "report" / "viewer.html").read_text()
    assert "broken: ValueError: bug in a reward function" in viewer
    # Issue 54 H2: the policy of the run directory renders, token for token, the prompt training
    # rendered: the task's own system text, the format's text and the tool list
    import asyncio

    from fakes.scripted_engine import ScriptedEngine

    from asyncrl.api import from_environment, load_policy, rollouts

    monkeypatch.syspath_prepend(str(tmp_path))
    policy = load_policy(run_dir)
    assert policy.system_prompt.startswith("Multiply.\n\n") and "multiply" in (
        policy.system_prompt)
    from mul_env import MulTaskset

    task = from_environment(MulTaskset, tokenizer=policy.tokenizer)
    by_id = {p.id: p for p in task.problems}
    saved = {r["prompt_id"]: r["prompt_ids"] for r in rolls}
    eng = ScriptedEngine([policy.tokenizer.encode("42")], policy.tokenizer)

    async def embedded() -> None:  # the embedding guide's call, with no system_prompt
        async for _ in rollouts([by_id[i] for i in list(saved)[:2]], engines=[eng],
                                policy=policy, tools=task.tools, reward_fn=task.reward_fn):
            pass

    asyncio.run(embedded())
    assert sorted(list(r.input_ids) for r in eng.requests) == sorted(saved[i] for i in
                                                                     list(saved)[:2])


def test_the_example_curriculum_names_a_verifiers_taskset_and_checks() -> None:
    """examples/verifiers_arith/ (written as for prime-rl) is configured, not coded: its
    curriculum resolves to the taskset's tasks, reward and tools."""
    from micro_config import ROOT

    from asyncrl import config
    from asyncrl.tasks.check import check_task

    cfg = config.load(ROOT / "examples" / "verifiers_arith" / "curriculum.toml")
    lines = check_task(cfg)
    assert lines[0].startswith("task source generator:examples.verifiers_arith.arith_env:"
                               "ArithTaskset: 384 train problems")
    assert "reward: auto (the task source's own)" in lines


@pytest.mark.slow
def test_the_example_curriculum_trains(tmp_path) -> None:
    import subprocess
    import sys

    from micro_config import ROOT, RUN_ENV, metric_rows

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train",
                           "examples/verifiers_arith/curriculum.toml", "--run-dir",
                           str(run_dir)], cwd=ROOT, env=RUN_ENV, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert [r["step"] for r in metric_rows(run_dir, "rl_step")] == [1, 2, 3, 4]
    assert all("rollout/reward_part/correct" in r for r in metric_rows(run_dir, "rl_step"))
