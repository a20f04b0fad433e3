"""Names in a curriculum resolved to Python objects: built-ins, `module:attr`, entry points.

Owns `resolve(spec, kind=..., key=..., builtins=...)`. A spec is one of:
- a built-in name (`math`, `python`, `tiny_math`, `reasoning_gym`), looked up in `builtins`;
- a dotted path `package.module:attr` (`attr` may itself be dotted: `mod:Class.method`),
  imported with the current working directory on `sys.path`, and the curriculum's own
  directory after it (`add_curriculum_dir`, called by the CLI), so a curriculum can name a
  module that sits beside it from wherever it is run;
- the name of an installed entry point in the group `asyncrl.<kind>` (a package declares
  `[project.entry-points."asyncrl.rewards"] my_reward = "my_pkg.rewards:score"`).

Every failure is a `ConfigError` naming the key, with "did you mean" when a close name exists.
Does not own: what the resolved object is used for (`asyncrl.tasks.source`, `wiring`).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from asyncrl.errors import ConfigError

GROUPS = {"tasks": "asyncrl.tasks", "rewards": "asyncrl.rewards", "tools": "asyncrl.tools"}
"""Entry-point group of each kind of plugin."""


def _hint(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def add_curriculum_dir(curriculum: str | os.PathLike[str]) -> None:
    """Put the directory of the curriculum file on `sys.path` (after what is there), so its
    plugin modules import when the command runs from elsewhere."""
    where = os.path.dirname(os.path.abspath(curriculum))
    if where not in sys.path:
        sys.path.append(where)


def _import(spec: str, key: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(key, f"{spec!r}: a plugin path is `module:attr`")
    cwd = os.getcwd()
    if cwd not in sys.path:  # a module beside the curriculum is importable, as with `python -m`
        sys.path.append(cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name
                                   or module_name.startswith(e.name + ".")):
            raise ConfigError(key, f"cannot import module {module_name!r} (not installed, and "
                              f"not a file under {cwd})") from None
        raise ConfigError(key, f"importing {module_name!r} failed: {e}") from None
    except Exception as e:  # the plugin's own import-time error: say whose it is
        raise ConfigError(key, f"importing {module_name!r} failed: "
                          f"{type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            known = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(key, f"{getattr(obj, '__name__', module_name)!r} has no "
                              f"attribute {part!r}{_hint(part, known)}")
        obj = getattr(obj, part)
    return obj


def installed(kind: str) -> dict[str, Any]:
    """The entry points of group `asyncrl.<kind>` installed here, by name."""
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


def resolve(spec: str, *, kind: str, key: str,
            builtins: Mapping[str, Callable[[], Any]]) -> Any:
    """The object `spec` names (see the module docstring). `builtins` maps built-in names to
    zero-argument loaders (imported only when named). Raises `ConfigError(key, ...)`."""
    if not spec:
        raise ConfigError(key, f"empty name; built-in: {', '.join(sorted(builtins))}")
    if ":" in spec:
        return _import(spec, key)
    if spec in builtins:
        return builtins[spec]()
    eps = installed(kind)
    if spec in eps:
        try:
            return eps[spec].load()
        except Exception as e:  # the plugin's import failed: say which entry point
            raise ConfigError(key, f"entry point {spec!r} ({eps[spec].value}) failed to "
                              f"load: {type(e).__name__}: {e}") from None
    known = sorted({*builtins, *eps})
    raise ConfigError(key, f"unknown {kind[:-1]} {spec!r}{_hint(spec, known)} (built-in or "
                      f"installed: {', '.join(known)}; or a plugin `module:attr`)")
