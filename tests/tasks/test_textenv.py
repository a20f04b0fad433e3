"""Text environments in the agent loop: a real skyrl-gym multi-turn environment answers the
model's turns with observations and ends the episode with its reward; one that raises fails
its rollout only; `asyncrl train` runs RL steps on it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fakes.scripted_engine import ScriptedEngine
from micro_config import (
    MICRO_MODEL,
    MICRO_RL_TAIL,
    metric_rows,
    micro_rollout,
    run_ok,
    saved_rollouts,
)

from asyncrl.api import RolloutSettings, rollouts
from asyncrl.errors import ConfigError
from asyncrl.records import Problem
from asyncrl.tasks.bridges.textenv import skyrl_source, text_env_source
from asyncrl.tasks.source import adapt
from asyncrl.tasks.task import TaskContext
from asyncrl.tasks.wiring import build_reward

skyrl_gym = pytest.importorskip("skyrl_gym")  # installed by dev: tests/test_dev_extras.py

ROWS = [{"id": f"g{i}", "question": f"Tom has {a} apples and buys {b} more. How many now?",
         "answer": str(a + b)} for i, (a, b) in enumerate([(3, 4), (10, 5), (7, 8), (2, 9),
                                                            (6, 6), (12, 1)])]


def _file(tmp_path: Path, rows: list[dict]) -> str:
    p = tmp_path / "gsm.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


async def _run(tok, src, script, settings=None):
    reward = build_reward("auto", src, TaskContext(tokenizer=tok))
    env = src.env(TaskContext(tokenizer=tok))
    eng = ScriptedEngine([tok.encode(t) for t in script], tok)
    (ro,) = [r async for r in rollouts(src.train[:1], engines=[eng], tokenizer=tok,
                                       reward_fn=reward, env=env,
                                       settings=settings or RolloutSettings(
                                           max_response_tokens=300, max_turns=5))]
    return ro, eng


async def test_a_skyrl_gym_multi_turn_env_answers_turns_and_rewards(tmp_path, tiny_tokenizer
                                                                   ) -> None:
    tok = tiny_tokenizer
    src = skyrl_source({"env": "gsm8k_multi_turn", "train_file": _file(tmp_path, ROWS),
                        "extras": {"max_turns": 3}}, 0)
    assert src.name == "skyrl_gym/gsm8k_multi_turn" and len(src.train) == 6
    ro, eng = await _run(tok, src, ["I think #### 6<|im_end|>", "#### 7<|im_end|>"])
    assert [t.role for t in ro.turns] == ["assistant", "environment", "assistant"]
    obs = ro.turns[1]
    assert set(ro.loss_mask[obs.start:obs.end]) == {0}  # observations are not trained on
    assert "#### ANSWER" in tok.decode(ro.response_ids[obs.start:obs.end])
    assert "#### ANSWER" in tok.decode(eng.requests[1].input_ids)  # the model saw it
    # skyrl-gym's own per-turn rewards: format credit 0.2/3 for a wrong answer, 1.0 correct
    assert ro.reward_detail == pytest.approx({"step_1": 0.2 / 3, "step_2": 1.0})
    assert (ro.status.value, ro.reward) == ("completed", pytest.approx(1.0 + 0.2 / 3))


async def test_an_env_that_raises_fails_its_rollout_only(tiny_tokenizer) -> None:
    class Broken:
        def step(self, action: str) -> dict:
            raise RuntimeError("env bug")

    probs = [Problem(id="p", question="Say hi", answer="hi")]
    src = text_env_source("broken", probs, [], lambda p: Broken())
    ro, _ = await _run(tiny_tokenizer, src, ["hi<|im_end|>"])
    assert (ro.status.value, ro.stop_reason.value) == ("failed", "error")
    assert ro.error.startswith("environment: RuntimeError('env bug')")
    assert (ro.reward, ro.reward_status) == (0.0, "no_answer")


class _Returns:
    def __init__(self, out):
        self.out = out

    def step(self, action: str):
        return self.out


@pytest.mark.parametrize(("out", "why"), [
    (("Higher.", 0.0, False, {}), "step returned a gym-style tuple"),
    ("Higher.", "step returned a str"),
    ({"observations": [], "reward": 1.0}, "step returned no bool 'done'"),
    ({"observations": "Higher.", "reward": 0.0, "done": False}, "step returned 'observations' = 'Higher.'"),
    ({"observations": [], "reward": "1", "done": True}, "step returned 'reward' = '1', not a number"),
], ids=["gym_tuple", "bare_string", "no_done", "str_observations", "str_reward"])
async def test_a_step_of_the_wrong_shape_says_the_expected_one(tiny_tokenizer, out, why
                                                               ) -> None:
    """Issue 54 M4: a gym tuple gave `'tuple' object has no attribute 'get'`, and a missing
    `done` was silently "not done" even after a reward of 1.0."""
    from asyncrl.observe.metrics import rollout_stats

    probs = [Problem(id="p", question="Guess", answer="3")]
    src = text_env_source("shape", probs, [], lambda p: _Returns(out))
    ro, _ = await _run(tiny_tokenizer, src, ["3<|im_end|>"])
    assert ro.status.value == "failed" and ro.error.startswith(f"environment: {why}")
    assert '"done": bool' in ro.error  # the expected shape, stated
    # the same fault in a turn cut by the budget is stepped at reward time: counted the same
    # way, once (issue 54 M5)
    cut, _ = await _run(tiny_tokenizer, src, ["3 3 3 3 3 3 3 3 3 3"],
                        RolloutSettings(max_response_tokens=4, max_turns=5))
    assert (cut.reward_status, cut.reward_errors[0][:len(why) + 13]) == (
        "reward_error", f"environment: {why}")
    m = rollout_stats([ro, cut])
    assert (m["rollout/env_error_count"], m["rollout/reward_error_count"]) == (2.0, 0.0)


def test_a_wrong_skyrl_env_id_says_did_you_mean(tmp_path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'gsm8k_multi_turn'"):
        skyrl_source({"env": "gsm8k_multiturn", "train_file": _file(tmp_path, ROWS)}, 0)
    assert adapt(skyrl_source, "skyrl_gym", {"env": "gsm8k", "train_file": _file(
        tmp_path, ROWS)}, 0).env is not None
    assert skyrl_gym.__name__ == "skyrl_gym"


def test_asyncrl_train_runs_rl_steps_on_a_skyrl_gym_env(tmp_path) -> None:
    train = _file(tmp_path, ROWS)
    cfg = tmp_path / "skyrl.toml"
    cfg.write_text(MICRO_MODEL + f"""
[data]
train = "generator:skyrl_gym"
eval = "generator:skyrl_gym"
max_prompt_tokens = 256
[data.generator_options]
env = "gsm8k_multi_turn"
train_file = "{train}"
eval_file = "{train}"
extras = {{ max_turns = 2 }}
[rollout]
prompts_per_step = 2
samples_per_prompt = 4
group_size = 2
max_turns = 2
max_response_tokens = 24
tools = false
[roc]
kind = "grpo_all"
reject_equal_reward = false
""" + MICRO_RL_TAIL)
    run_dir = tmp_path / "run"
    run_ok([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir)])
    steps = metric_rows(run_dir, "rl_step")
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["train/optimizer_step"] == 2.0
    rolls = saved_rollouts(run_dir)
    assert len(rolls) == 16
    for r in rolls:  # each rollout stepped the environment: its rewards are skyrl-gym's
        assert r["reward_detail"] and set(r["reward_detail"]) <= {"step_1", "step_2"}
        assert r["reward"] == pytest.approx(sum(r["reward_detail"].values()))
    assert metric_rows(run_dir, "eval")
    assert all("rollout/reward_part/step_1" in r for r in steps)
    assert all(r["rollout/env_error_count"] == 0.0 for r in steps)


def test_skyrl_dataset_rows_in_skyrls_own_layout_are_read(tmp_path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "Think."},
                        {"role": "user", "content": "What is 2 + 2?"}],
             "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule",
                                                              "ground_truth": "4"},
             "extra_info": {"max_turns": 2}},
            {"prompt": [{"role": "user", "content": "no answer here"}]}]
    src = skyrl_source({"env": "gsm8k_multi_turn", "train_file": _file(tmp_path, rows)}, 0)
    assert [(p.question, p.answer) for p in src.train] == [("What is 2 + 2?", "4")]
    assert src.dropped == {"missing_field": 1}


HUNG_ENV = '''
import time
from asyncrl.records import Problem
from asyncrl.tasks.bridges.textenv import text_env_source


class Hung:
    def step(self, action):
        time.sleep(3600)  # a socket read with no timeout, a deadlock: it never returns


def make_source(options, seed):
    probs = [Problem(id=f"p{i}", question=f"Guess a number {i}", answer="3") for i in range(8)]
    return text_env_source("hung", probs[:6], probs[6:], lambda p: Hung())
'''


def test_a_run_whose_env_step_hangs_ends_and_names_it(tmp_path) -> None:
    """Issue 54 H1: each step was cut at its deadline, `run_done` was logged, and then the
    process never exited (the default executor's thread was joined at shutdown). Now the
    run ends within its deadlines plus a few seconds and says what hung."""
    import subprocess
    import time

    from micro_config import RUN_ENV

    (tmp_path / "hung_env.py").write_text(HUNG_ENV)
    cfg = tmp_path / "hung.toml"
    cfg.write_text(MICRO_MODEL + """
[data]
train = "generator:hung_env:make_source"
eval = "generator:hung_env:make_source"
max_prompt_tokens = 256
[rollout]
prompts_per_step = 2
samples_per_prompt = 2
group_size = 2
max_turns = 2
max_response_tokens = 16
tools = false
tool_timeout_s = 1.0
reward_timeout_s = 1.0
[roc]
kind = "grpo_all"
reject_equal_reward = false
""" + MICRO_RL_TAIL.replace("steps = 2", "steps = 1").replace("every_steps = 2",
                                                                "every_steps = 0"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg),
                           "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                          env={**RUN_ENV, "PYTHONPATH": f"{Path(__file__).parents[2]}"},
                          capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert "sync_call_abandoned" in out and "environment step" in out, out[-3000:]
    assert "never returned after their deadline (environment step" in proc.stderr
    # every rollout failed or went unscored: the run stops in its first step (issue 54 M3)
    assert proc.returncode == 1, out[-3000:]
    assert "so the run stops" in proc.stderr and "RL step 1" in proc.stderr
    assert took < 200, took


def test_one_sigint_stops_a_run_whose_env_step_is_stuck(tmp_path) -> None:
    """Issue 54's bar: a worker thread stuck in user code (an environment step with a 10-minute
    deadline) does not keep one Ctrl-C from ending the run: it exits 130 within seconds."""
    import signal
    import subprocess
    import time

    from micro_config import RUN_ENV

    (tmp_path / "hung_env.py").write_text(HUNG_ENV.replace(
        "        time.sleep(3600)",
        "        open('stepping', 'w').close()\n        time.sleep(3600)"))
    cfg = tmp_path / "hung.toml"
    cfg.write_text(MICRO_MODEL + """
[data]
train = "generator:hung_env:make_source"
eval = "generator:hung_env:make_source"
max_prompt_tokens = 256
""" + micro_rollout(roc={"kind": "grpo_all", "reject_equal_reward": False, "min_pos": None,
                         "min_neg": None}, samples_per_prompt=2, max_response_tokens=16,
                    tools=False, tool_format=None, tool_timeout_s=600.0,
                    reward_timeout_s=600.0) + MICRO_RL_TAIL)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg),
                             "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                            env={**RUN_ENV, "PYTHONPATH": f"{Path(__file__).parents[2]}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "stepping").exists():  # a step is now stuck in its thread
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "stopped by SIGINT" in out
    assert took < 60, took


def _skyrl_row(question: str, answer: str) -> dict:
    return {"data_source": "gsm8k", "prompt": [{"role": "user", "content": question}],
            "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": answer},
            "extra_info": {"split": "x"}}


async def test_train_and_eval_files_in_skyrls_layout_keep_their_own_answers(
        tmp_path, tiny_tokenizer) -> None:
    """G1: rows without `id` were `row-0, row-1, ...` in both files, so a training rollout's
    environment was built with the eval row's ground truth and the right answer scored 0."""
    (tmp_path / "t").mkdir()
    (tmp_path / "e").mkdir()
    train = _file(tmp_path / "t", [_skyrl_row("What is 2+2?", "4")])
    eval_ = _file(tmp_path / "e", [_skyrl_row("What is 3+3?", "6")])
    src = skyrl_source({"env": "gsm8k", "train_file": train, "eval_file": eval_}, 0)
    assert len({p.id for p in [*src.train, *src.eval]}) == 2
    ro, _ = await _run(tiny_tokenizer, src, ["#### 4<|im_end|>"])
    assert ro.reward == 1.0


def test_a_text_env_source_refuses_an_id_shared_by_two_problems() -> None:
    p = Problem(id="q1", question="a?", answer="1")
    with pytest.raises(ConfigError, match="two different problems have the id 'q1'"):
        text_env_source("mine", [p], [Problem(id="q1", question="b?", answer="2")],
                        lambda _: None)
    # one file as both splits: the same problem under its id, one environment for it
    assert text_env_source("mine", [p], [Problem(id="q1", question="a?", answer="1")],
                           lambda _: None).eval[0].id == "q1"


def test_config_check_builds_one_environment_and_names_one_that_cannot_be_built() -> None:
    """Issue 54 M3: a `make_env` that always raised passed config check and the dry run and
    failed every rollout of the run; config check now builds (and closes) one."""
    from asyncrl.tasks.trial import trial_env

    probs = [Problem(id=f"p{i}", question=f"Guess {i}", answer="3") for i in range(3)]
    built: list[str] = []

    class Env:
        def __init__(self, p: Problem) -> None:
            built.append(p.id)

        def close(self) -> None:
            built.append("closed")

    line = trial_env(text_env_source("guess", probs, [], Env))
    assert built == ["p0", "closed"] and line is not None and "built and closed" in line

    def broken(p: Problem) -> None:
        raise KeyError("the env's data file has no column 'target'")

    with pytest.raises(ConfigError, match=r"environment of broken raised on a trial call: "
                                          r"KeyError") as e:
        trial_env(text_env_source("broken", probs, [], broken))
    assert e.value.key == "data.train"
