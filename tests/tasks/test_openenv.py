"""An openenv environment in-process through the text-environment loop: its `reset` is the
problem, its `step` answers each turn, its observations' rewards are the reward. openenv is an
optional extra (about 100 packages): not installed by `dev`, so this test skips without it."""

from __future__ import annotations

import random

import pytest
from fakes.scripted_engine import ScriptedEngine

pytest.importorskip("openenv.core.env_server.interfaces")

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from asyncrl.api import RolloutSettings, rollouts
from asyncrl.tasks.bridges.openenv import openenv_source
from asyncrl.tasks.task import TaskContext
from asyncrl.tasks.wiring import build_reward


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    prompt: str


class MulEnv(Environment[GuessAction, GuessObservation, State]):
    """Multiply two numbers; a wrong guess is told to try again (two tries)."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        rng = random.Random(seed)
        self.a, self.b, self.tries = rng.randint(10, 99), rng.randint(10, 99), 0
        return GuessObservation(prompt=f"What is {self.a} times {self.b}?")

    def step(self, action, timeout_s=None, **kwargs):
        self.tries += 1
        right = str(self.a * self.b) in action.guess
        done = right or self.tries >= 2
        return GuessObservation(prompt="" if done else "Wrong, try again.", done=done,
                                reward=1.0 if right else 0.0)

    @property
    def state(self):
        return State()


async def test_an_openenv_environment_runs_episodes_in_the_loop(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    src = openenv_source({"env": "test_openenv:MulEnv", "train_size": 4, "eval_size": 2}, 0)
    assert (len(src.train), len(src.eval)) == (4, 2)
    p = src.train[0]
    a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" times "))
    eng = ScriptedEngine([tok.encode("7<|im_end|>"), tok.encode(f"{a * b}<|im_end|>")], tok)
    ctx = TaskContext(tokenizer=tok)
    (ro,) = [r async for r in rollouts([p], engines=[eng], tokenizer=tok,
                                       reward_fn=build_reward("auto", src, ctx),
                                       env=src.env(ctx),
                                       settings=RolloutSettings(max_response_tokens=200))]
    assert [t.role for t in ro.turns] == ["assistant", "environment", "assistant"]
    assert "Wrong, try again." in tok.decode(eng.requests[1].input_ids)
    assert (ro.reward, ro.reward_detail) == (1.0, {"step_1": 0.0, "step_2": 1.0})
