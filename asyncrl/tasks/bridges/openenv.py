"""openenv environments (`openenv.core.env_server.Environment`) in-process, as text
environments (`asyncrl.tasks.bridges.textenv`): the built-in `openenv` task source.

Owns turning an openenv `Environment` class into problems and episodes:
- a problem is an episode's opening: `reset(seed=s)`'s observation as text, for seeds
  `run.seed * 10^6 + i` (training) and those plus `eval_seed_offset` (held out), deduplicated
  by question text; its answer is empty (the environment scores);
- each rollout runs its own environment instance, reset with the problem's seed; each
  assistant turn without a tool call is `step(Action(**{action_field: text}))`; the
  observation's text is the next user turn until `done`; the reward is the sum of the
  observations' `reward`s (as any text environment's).

An observation's text is its one string field besides `done`, `reward` and `metadata` (or the
field named by `observation_field`), else those fields as JSON.
Options (`data.generator_options`): `env` (`module:Class`), `env_kwargs`, `action`
(`module:Class`; default: the environment's generic action type), `action_field` (default:
the action's one string field), `observation_field`, `train_size` (256), `eval_size` (32),
`eval_seed_offset` (10^6). Needs `pip install 'asyncrl[openenv]'` (about 100 packages).
Not owned: openenv's HTTP/WebSocket client, Docker or Hub environments (served ones would need
its `/ws` session client: its HTTP `/step` builds a fresh environment per request).
"""

from __future__ import annotations

import json
from typing import Any, get_args

from asyncrl.errors import ConfigError
from asyncrl.records import Problem
from asyncrl.tasks.bridges.textenv import text_env_source
from asyncrl.tasks.plugins import resolve
from asyncrl.tasks.task import TaskSource

OPTIONS: dict[str, Any] = {"env": "", "env_kwargs": {}, "action": "", "action_field": "",
                           "observation_field": "", "train_size": 256, "eval_size": 32,
                           "eval_seed_offset": 1_000_000}
_BASE_FIELDS = {"done", "reward", "metadata"}
KEY = "data.generator_options"


def _action_type(env_cls: type, spec: str) -> Any:
    from openenv.core.env_server.types import Action

    if spec:
        return resolve(spec, kind="tasks", key=f"{KEY}.action", builtins={})
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, Action):
                    return arg
    raise ConfigError(f"{KEY}.action", f"{env_cls.__name__} does not declare its action type "
                      "(Environment[MyAction, ...]): name it, `module:Class`")


def _text_field(model: type, spec: str, key: str, what: str) -> str:
    fields = model.model_fields  # type: ignore[attr-defined]
    if spec:
        if spec not in fields:
            raise ConfigError(key, f"{model.__name__} has no field {spec!r} (fields: "
                              f"{', '.join(fields)})")
        return spec
    text = [n for n, f in fields.items() if n not in _BASE_FIELDS and f.annotation is str]
    if len(text) != 1:
        raise ConfigError(key, f"{model.__name__} has {len(text)} string fields: name the "
                          f"one that carries the {what}")
    return text[0]


def observation_text(obs: Any, field: str = "") -> str:
    """The text of an openenv observation (see the module docstring)."""
    data = obs.model_dump()
    if field:
        return str(data.get(field, ""))
    rest = {k: v for k, v in data.items() if k not in _BASE_FIELDS}
    strings = [v for v in rest.values() if isinstance(v, str)]
    if len(strings) == 1:
        return str(strings[0])
    if len(rest) == 1:
        return str(next(iter(rest.values())))
    return json.dumps(rest, default=str)


class _Episode:
    """skyrl-gym's `step`/`close` over an openenv environment."""

    def __init__(self, env: Any, action: Any, field: str, obs_field: str) -> None:
        self.env, self.action, self.field, self.obs_field = env, action, field, obs_field

    def step(self, text: str) -> dict[str, Any]:
        obs = self.env.step(self.action(**{self.field: text}))
        return {"observations": [{"role": "user",
                                  "content": observation_text(obs, self.obs_field)}],
                "reward": float(obs.reward or 0.0), "done": bool(obs.done)}

    def close(self) -> None:
        self.env.close()


def openenv_source(options: dict[str, Any], seed: int) -> TaskSource:
    """The built-in `openenv` source (options in the module docstring)."""
    from openenv.core.env_server.interfaces import Environment

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(KEY, f"openenv: unknown option {unknown[0]!r}; known: "
                          f"{', '.join(OPTIONS)}")
    opts = {**OPTIONS, **options}
    env_cls = resolve(opts["env"], kind="tasks", key=f"{KEY}.env", builtins={})
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ConfigError(f"{KEY}.env", f"{opts['env']!r} is not an openenv Environment class")
    action = _action_type(env_cls, opts["action"])
    field = _text_field(action, opts["action_field"], f"{KEY}.action_field", "model's text")
    kwargs = dict(opts["env_kwargs"])
    obs_field = opts["observation_field"]

    seed_of: dict[str, int] = {}
    """Each problem's episode seed, kept beside it (an id's text is not parsed back: a negative
    `run.seed` gives ids such as `openenv-train--1000000`)."""

    def openings(split: str, seeds: range, taken: set[str]) -> tuple[list[Problem], int]:
        out: list[Problem] = []
        dup = 0
        for s in seeds:
            env = env_cls(**kwargs)
            try:
                question = observation_text(env.reset(seed=s), obs_field).strip()
            finally:
                env.close()
            if not question or question in taken:
                dup += 1
                continue
            taken.add(question)
            seed_of[f"openenv-{split}-{s}"] = s
            out.append(Problem(id=f"openenv-{split}-{s}", question=question, answer="",
                               source=f"openenv/{env_cls.__name__}"))
        return out, dup

    base = seed * 1_000_000
    taken: set[str] = set()
    eval_, d_eval = openings("eval", range(base + opts["eval_seed_offset"], base
                                           + opts["eval_seed_offset"] + opts["eval_size"]),
                             taken)
    train, d_train = openings("train", range(base, base + opts["train_size"]), taken)

    def make_env(problem: Problem) -> Any:
        env = env_cls(**kwargs)
        env.reset(seed=seed_of[problem.id])
        return _Episode(env, action, field, obs_field)

    return text_env_source(f"openenv/{env_cls.__name__}", train, eval_, make_env,
                           dropped={"duplicate_question": d_train} if d_train else {},
                           dropped_eval={"duplicate_question": d_eval} if d_eval else {})
