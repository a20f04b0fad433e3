"""Task sources: where a run's problems come from, and what else the source brings.

Owns the one parser of `generator:NAME` (`source_name`) and `load_source(name, options,
seed)`, which turns what `data.train = "generator:NAME"` names into a `TaskSource`:

- a built-in task family (`asyncrl.tasks.families`: `tiny_math`, `reasoning_gym`);
- a `TaskSource`, or a callable `(options, seed) -> TaskSource | (train, eval) | any of these`;
- a verifiers taskset (0.4+: a `verifiers.v1.Taskset` class or instance), adapted and scored
  by verifiers' own code (`asyncrl.tasks.bridges.verifiers`); a classic verifiers environment
  (<= 0.3) is refused with a message;
- `skyrl_gym`: skyrl-gym's registered text environments (`asyncrl.tasks.bridges.textenv`), or
  a plugin returning `textenv.text_env_source(...)` for an environment of its own;
- `openenv`: openenv `Environment` classes in-process (`asyncrl.tasks.bridges.openenv`).

Each call builds the source anew: a run loads it once and holds it (`asyncrl.tasks.open`).
Does not own: name resolution (`plugins`), reading problem files (`files`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.records import Problem
from asyncrl.tasks.plugins import resolve
from asyncrl.tasks.task import TaskSource

__all__ = ["GENERATOR_PREFIX", "adapt", "load_source", "named", "source_name"]

GENERATOR_PREFIX = "generator:"


def source_name(spec: str, key: str = "data.train") -> str | None:
    """The task source's name in `spec` (`generator:NAME` -> `NAME`); None for a file path.
    An empty name is a `ConfigError` naming `key`."""
    if not spec.startswith(GENERATOR_PREFIX):
        return None
    name = spec[len(GENERATOR_PREFIX):]
    if not name:
        raise ConfigError(key, f"{spec!r}: name a task source after {GENERATOR_PREFIX!r}")
    return name


def named(name: str) -> str:
    """The spec that names task source `name` (`NAME` -> `generator:NAME`)."""
    return GENERATOR_PREFIX + name


def builtin_sources() -> dict[str, Callable[[], Any]]:
    from asyncrl.tasks import families

    def skyrl() -> Any:
        from asyncrl.tasks.bridges.textenv import skyrl_source

        return skyrl_source

    def family(name: str) -> Callable[[], Any]:
        return lambda: families.TASK_FAMILIES[name]

    def openenv() -> Any:
        from asyncrl.tasks.bridges.openenv import openenv_source

        return openenv_source

    return {"skyrl_gym": skyrl, "openenv": openenv,
            **{name: family(name) for name in families.TASK_FAMILIES}}


def load_source(name: str, options: Mapping[str, Any], seed: int, *,
                key: str = "data.train") -> TaskSource:
    """The task source `name` names (see the module docstring), built with `options`
    (`data.generator_options`) and `seed` (`run.seed`). Errors are `ConfigError(key, ...)`."""
    try:
        obj = resolve(name, kind="tasks", key=key, builtins=builtin_sources())
        return adapt(obj, name, dict(options), seed, key=key)
    except ModuleNotFoundError as e:  # a source's own package, imported when it is built
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        raise ConfigError(key, f"{named(name)} needs {top!r}, which is not installed: pip "
                          f"install 'asyncrl[{EXTRAS[top]}]'") from None


EXTRAS = {"reasoning_gym": "reasoning-gym", "skyrl_gym": "skyrl-gym", "verifiers": "verifiers",
          "openenv": "openenv"}
"""The package each built-in or bridged source imports, and the extra that installs it."""


def _is_from(obj: Any, package: str) -> bool:
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    return any(c.__module__ == package or c.__module__.startswith(package + ".")
               for c in classes)


def _rows_checked(src: TaskSource, key: str) -> TaskSource:
    """`src`, unless a split holds something other than `Problem`s (dict rows, strings): a
    config error naming the key and the expected type, not a traceback later."""
    for split, rows in (("train", src.train), ("eval", src.eval)):
        bad = next(((i, r) for i, r in enumerate(rows) if not isinstance(r, Problem)), None)
        if bad is not None:
            raise ConfigError(key, f"task source {src.name!r}: {split} item {bad[0]} is a "
                              f"{type(bad[1]).__name__}, not an asyncrl.Problem (build rows "
                              "as Problem(id=..., question=..., answer=...))")
    return src


def adapt(obj: Any, name: str, options: dict[str, Any], seed: int, *,
          key: str = "data.train") -> TaskSource:
    """`obj` (what a source name resolved to) as a `TaskSource`."""
    from asyncrl.tasks.families.base import TaskFamily

    if isinstance(obj, TaskSource):
        return _rows_checked(obj, key)
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
        from asyncrl.tasks.bridges import verifiers

        return verifiers.source(obj, name, options, seed, key=key)
    if _is_from(obj, "verifiers"):
        raise ConfigError(key, f"{name!r} is a classic verifiers environment (verifiers <= "
                          "0.3), which asyncrl does not adapt: its rubric is a RubricGroup whose "
                          "functions need verifiers' own parser and State. Port it to "
                          "verifiers.v1 (0.4) and name its Taskset")
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(s, list) for s in obj):
        return _rows_checked(TaskSource(name=name, train=list(obj[0]), eval=list(obj[1])), key)
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
