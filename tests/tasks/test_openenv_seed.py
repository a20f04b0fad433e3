"""The openenv bridge's own bookkeeping, with a minimal stand-in for openenv (the real package
is an optional extra that `dev` does not install): each problem's episode is reset with the
seed its opening was drawn with."""

from __future__ import annotations

import sys
import types
from typing import Generic, TypeVar

import pytest

BaseModel = pytest.importorskip("pydantic").BaseModel  # a dev dependency, absent on a GPU machine

A = TypeVar("A")
O = TypeVar("O")  # noqa: E741


class Action(BaseModel):
    pass


class Observation(BaseModel):
    done: bool = False
    reward: float | None = None


class Environment(Generic[A, O]):
    pass


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    prompt: str


RESETS: list[int] = []


class SeedEnv(Environment[GuessAction, GuessObservation]):
    def reset(self, seed=None, **kwargs):
        RESETS.append(seed)
        return GuessObservation(prompt=f"opening {seed}")

    def step(self, action):
        return GuessObservation(prompt="", done=True, reward=1.0)

    def close(self):
        pass


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["openenv", "openenv.core", "openenv.core.env_server"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    interfaces = types.ModuleType("openenv.core.env_server.interfaces")
    interfaces.Environment = Environment  # type: ignore[attr-defined]
    kinds = types.ModuleType("openenv.core.env_server.types")
    kinds.Action = Action  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, interfaces.__name__, interfaces)
    monkeypatch.setitem(sys.modules, kinds.__name__, kinds)
    monkeypatch.setitem(sys.modules, "seed_env_plugin", sys.modules[__name__])


@pytest.mark.parametrize("seed", [-1, 0, 3])
def test_each_episode_is_reset_with_its_openings_seed(stand_in: None, seed: int) -> None:
    """G12: with a negative run.seed the ids read `openenv-train--1000000` and the seed was
    read back as +1000000: the model saw one opening and was stepped in another episode."""
    from asyncrl.tasks.bridges import openenv, textenv

    src = openenv.openenv_source({"env": "seed_env_plugin:SeedEnv", "train_size": 2,
                                  "eval_size": 2}, seed)
    runner = src.reward.__self__  # type: ignore[union-attr]
    assert isinstance(runner, textenv.TextEnvRunner)
    for p in [*src.train, *src.eval]:
        RESETS.clear()
        runner.make_env(p)
        (s,) = RESETS
        assert SeedEnv().reset(seed=s).prompt == p.question
