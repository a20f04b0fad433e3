"""Task sources: where a run's problems come from, and what else the source brings.

Owns `TaskSource` (train and held-out problems, counts of items dropped, and optionally the
source's own reward, its own tools and the solution program of a problem for SFT
transcripts), `TaskContext` (what a reward or tool factory may use: the tokenizer, the
sandbox, the reward host) and `load_source(name, options, seed)`, which turns what
`data.train = "generator:NAME"` names into a `TaskSource`:

- a built-in task family (`asyncrl.tasks.TASK_FAMILIES`: `tiny_math`, `reasoning_gym`);
- a `TaskSource`, or a callable `(options, seed) -> TaskSource | (train, eval) | any of these`;
- a verifiers taskset (0.4+: a `verifiers.v1.Taskset` class or instance), adapted and scored
  by verifiers' own code (`asyncrl.envs.verifiers_v1`); a classic verifiers environment
  (<= 0.3) is refused with a message;
- `skyrl_gym`: skyrl-gym's registered text environments (`asyncrl.envs.textenv`), or a
  plugin returning `textenv.text_env_source(...)` for an environment of its own;

A source is built once per (name, options, seed) in a process: the train split, the held-out
split, the tokenizer corpus and the runtime's reward all see the same object.
Does not own: name resolution (`plugins`), reading problem files (`asyncrl.data`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.envs.base import RewardFactory, TaskContext, TaskSource, ToolFactory
from asyncrl.envs.plugins import resolve
from asyncrl.errors import ConfigError

__all__ = ["RewardFactory", "TaskContext", "TaskSource", "ToolFactory", "adapt", "clear_cache",
           "load_source"]


def builtin_sources() -> dict[str, Callable[[], Any]]:
    from asyncrl import tasks

    def skyrl() -> Any:
        from asyncrl.envs.textenv import skyrl_source

        return skyrl_source

    def family(name: str) -> Callable[[], Any]:
        return lambda: tasks.TASK_FAMILIES[name]

    def openenv() -> Any:
        from asyncrl.envs.openenv import openenv_source

        return openenv_source

    return {"skyrl_gym": skyrl, "openenv": openenv,
            **{name: family(name) for name in tasks.TASK_FAMILIES}}


_CACHE: dict[tuple[str, str, int], TaskSource] = {}


def load_source(name: str, options: Mapping[str, Any], seed: int, *,
                key: str = "data.train") -> TaskSource:
    """The task source `name` names (see the module docstring), built with `options`
    (`data.generator_options`) and `seed` (`run.seed`). Errors are `ConfigError(key, ...)`."""
    cache_key = (name, json.dumps(options, sort_keys=True, default=str), seed)
    if cache_key not in _CACHE:
        obj = resolve(name, kind="tasks", key=key, builtins=builtin_sources())
        _CACHE[cache_key] = adapt(obj, name, dict(options), seed, key=key)
    return _CACHE[cache_key]


def _is_from(obj: Any, package: str) -> bool:
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    return any(c.__module__ == package or c.__module__.startswith(package + ".")
               for c in classes)


def adapt(obj: Any, name: str, options: dict[str, Any], seed: int, *,
          key: str = "data.train") -> TaskSource:
    """`obj` (what a source name resolved to) as a `TaskSource`."""
    from asyncrl.tasks.base import TaskFamily

    if isinstance(obj, TaskSource):
        return obj
    if isinstance(obj, TaskFamily):
        try:
            opts = obj.resolve_options(options)
            train, eval_ = obj.make(opts, seed)
        except ValueError as e:
            raise ConfigError("data.generator_options", str(e)) from None
        return TaskSource(name=name, train=list(train), eval=list(eval_),
                          reward=obj.reward, solution_code=obj.solution_code,
                          dropped=dict(getattr(train, "dropped", None) or {}),
                          dropped_eval=dict(getattr(eval_, "dropped", None) or {}))
    if _is_from(obj, "verifiers.v1"):
        from asyncrl.envs import verifiers_v1

        return verifiers_v1.source(obj, name, options, seed, key=key)
    if _is_from(obj, "verifiers"):
        raise ConfigError(key, f"{name!r} is a classic verifiers environment (verifiers <= "
                          "0.3), which asyncrl does not adapt: its rubric is a RubricGroup whose "
                          "functions need verifiers' own parser and State. Port it to "
                          "verifiers.v1 (0.4) and name its Taskset")
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(s, list) for s in obj):
        return TaskSource(name=name, train=list(obj[0]), eval=list(obj[1]))
    if callable(obj):
        try:
            made = obj(options, seed)
        except ConfigError:
            raise
        except Exception as e:  # the plugin's own failure: say whose it is
            raise ConfigError(key, f"task source {name!r} raised {type(e).__name__}: "
                              f"{e}") from e
        return adapt(made, name, options, seed, key=key)
    raise ConfigError(key, f"{name!r} is a {type(obj).__name__}, not a task source: expected "
                      "a task family, a TaskSource, a callable (options, seed) -> TaskSource, "
                      "a verifiers taskset or environment, or a text environment factory")


def clear_cache() -> None:
    """Forget built sources (tests; a process that builds many runs)."""
    for src in _CACHE.values():
        if src.close is not None:
            src.close()
    _CACHE.clear()
