"""The checks of a task config that its schema cannot make, run before anything starts
(`asyncrl config check`, `asyncrl train --dry-run`, and `asyncrl train` itself).

Owns: a built-in task family's `data.generator_options` (names, with "did you mean", and
values, through the family's own `resolve_options`), and `check_task`: every plugin the config
names imported, the task source built and one item of each split produced, and each stage's
`source_weights` mix counted, as plan lines. A failure is a `ConfigError` naming the key.

Does not own: the schema's own checks (`asyncrl.config`), the KV budget of one rollout
(`asyncrl.policy.check_kv_budget`).
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING

from asyncrl.errors import ConfigError
from asyncrl.formats import PYTHON_TOOL, get_format
from asyncrl.tasks.plugins import resolve
from asyncrl.tasks.source import load_source, source_name
from asyncrl.tasks.stream import source_counts, source_mix
from asyncrl.tasks.task import TaskContext, TaskSource
from asyncrl.tasks.trial import trial_env, trial_reward
from asyncrl.tasks.wiring import REWARD_NAMES, TOOL_NAMES, _as_tools, _names, source_tools

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def check_generator_options(cfg: RunConfig) -> None:
    """`data.generator_options` as the `generator:` family of `data.train` / `data.eval` reads
    them: an unknown name (with the close one) or a bad value names its key."""
    from asyncrl.tasks.families import TASK_FAMILIES, get_family

    d = cfg.data
    for key in ("train", "eval"):
        name = source_name(getattr(d, key), f"data.{key}")
        if name is None or name not in TASK_FAMILIES:
            continue  # a file, a plugin source, or a typo: `check_task` names it, with a hint
        family = get_family(name)
        unknown = sorted(set(d.generator_options) - set(family.defaults))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(family.defaults), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"data.generator_options.{unknown[0]}",
                              f"not an option of {family.name}{hint} (known: "
                              f"{', '.join(sorted(family.defaults))})")
        try:
            family.resolve_options(d.generator_options)
        except ValueError as e:
            named = re.search(r"option '(\w+)'", str(e))
            where = f".{named.group(1)}" if named else ""
            raise ConfigError(f"data.generator_options{where}", str(e)) from None


def reward_line(reward: str, train: TaskSource | None, eval_: TaskSource | None,
                apart: bool) -> str:
    """The plan's `reward:` line: what scores each split, as `asyncrl.tasks.open.bind` builds
    it (a `data.eval` source other than `data.train`'s scores its problems with its own)."""
    from asyncrl.tasks.open import eval_reward_spec

    def what(src: TaskSource | None) -> str:
        own = reward in ("auto", "source") and src is not None and src.reward is not None
        return " (the task source's own)" if own else " (math)" if reward == "auto" else ""

    line = f"reward: {reward}{what(train)}"
    if apart and eval_ is not None:
        which = eval_reward_spec(reward, train, eval_)
        held = what(train) if which is None else (
            " (the eval source's own)" if which == "source" else f" ({which})")
        line = f"reward: {reward}; train{what(train) or ' ' + reward}; eval{held or ' ' + reward}"
    return line


def check_task(cfg: RunConfig) -> list[str]:
    """Import every plugin the config names, build the task source and one item of each
    split; the plan lines. Raises `ConfigError` naming the key."""
    lines: list[str] = []
    by_split: dict[str, TaskSource] = {}
    loaded: dict[str, TaskSource] = {}
    for key in ("train", "eval"):
        src = getattr(cfg.data, key)
        name = source_name(src, f"data.{key}")
        if name is None:
            continue
        if src not in loaded:
            loaded[src] = load_source(name, cfg.data.generator_options, cfg.run.seed,
                                      key=f"data.{key}")
        s = loaded[src]
        split = s.train if key == "train" else s.eval
        if not split:
            raise ConfigError(f"data.{key}", f"task source {src!r} gave no {key} problems")
        first = split[0]
        d = s.dropped if key == "train" else s.dropped_eval
        dropped = f", dropped {dict(d)}" if d else ""
        lines.append(f"task source {src}: {len(split)} {key} problems{dropped}; first: "
                     f"{first.question[:60]!r} -> {first.answer[:20]!r}")
        by_split[key] = s
    source = by_split.get("train")  # what the runtime builds the reward and tools from
    for i, st in enumerate(cfg.stages):
        if st.source_weights and source is not None:  # fails here, before a model loads
            mix = source_mix(source.train, st.source_weights, seed=cfg.run.seed, stage=i,
                             key=f"stages[{i}].source_weights")
            lines.append(f"stage {st.name}: {len(mix)} of the training problems by source "
                         f"{source_counts(mix)} (before the prompt-length filter)")
    reward = cfg.task.reward
    trials: list[str | None] = [trial_env(source)] if source is not None else []
    if reward not in REWARD_NAMES:
        obj = resolve(reward, kind="rewards", key="task.reward", builtins=_names(REWARD_NAMES))
        if not callable(obj):
            raise ConfigError("task.reward", f"{reward!r} is a {type(obj).__name__}, not a "
                              "function")
        if source is not None and source.train:
            trials.append(trial_reward(reward, obj, source.train[0]))
    elif reward == "source" and (source is None or source.reward is None):
        raise ConfigError("task.reward", "\"source\": the task source has no reward of its own")
    lines.append(reward_line(reward, source, by_split.get("eval"),
                             cfg.data.eval != cfg.data.train))
    names = resolved_tools(cfg, source)
    if not cfg.rollout.tools:
        lines.append("tools: (none)")
    else:
        lines.append(f"tools: {', '.join(names) or '(none)'} (task.tools = "
                     f"{list(cfg.task.tools)}, format {cfg.rollout.tool_format})")
        why = get_format(cfg.rollout.tool_format).uncallable(names)
        if why:
            raise ConfigError("rollout.tool_format", f"{why}: {FORMAT_FIX}")
    if source is not None and source.env is not None:
        lines.append(f"text environment: {source.name} (each rollout steps its own; "
                     "observations become user turns)")
    return lines + [t for t in trials if t]


FORMAT_FIX = 'set rollout.tool_format = "hermes" for tools other than the Python one'
"""How a curriculum fixes a tool its format cannot call (`ToolFormat.uncallable`)."""


def resolved_tools(cfg: RunConfig, source: TaskSource | None) -> list[str]:
    """The names of the tools `[task] tools` gives the model, in order, built as a run builds
    them but with no sandbox (the Python tool is named, not opened). Raises `ConfigError`
    naming `task.tools` for an unknown name or a source whose tools fail to build."""
    if not cfg.rollout.tools:
        return []
    ctx = TaskContext(max_output_chars=cfg.rollout.tool_output_max_chars)
    names: list[str] = []
    for spec in cfg.task.tools:
        if spec == "python" or (spec == "auto" and (source is None or source.tools is None)):
            names.append(PYTHON_TOOL)
        elif spec in ("auto", "source"):
            if source is None or source.tools is None:
                raise ConfigError("task.tools", "\"source\": the task source has no tools of "
                                  "its own")
            names += [t.name for t in source_tools(source, ctx)]
        else:
            obj = resolve(spec, kind="tools", key="task.tools", builtins=_names(TOOL_NAMES))
            names += [t.name for t in _as_tools(obj, spec, ctx)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError("task.tools", f"two tools are named {dup[0]!r}")
    return names
