"""`asyncrl train --dry-run` and `asyncrl config check`: a curriculum's plan, resolved without
starting anything heavy (no model, engine, trainer or sandbox)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from asyncrl.algo.schedule import stage_lr
from asyncrl.config import DistillSection, RunConfig
from asyncrl.engine.registry import ENGINE_KINDS
from asyncrl.errors import ConfigError
from asyncrl.policy import check_kv_budget
from asyncrl.stages import stage_budget
from asyncrl.tasks.check import check_generator_options, check_task
from asyncrl.tasks.source import source_name
from asyncrl.trainer import TRAINER_KINDS


def dry_run(cfg: RunConfig, *, missing: list[ConfigError] | None = None) -> list[str]:
    """Resolve every stage, data file and component without starting anything heavy.

    Returns the plan as lines. An unknown component always raises `ConfigError`. A path that
    is not on this machine (model, data or chat file) raises `ConfigError` naming its key
    when `missing` is None; given a list, each such error is appended to it instead and the
    plan goes on, so a recipe meant for another machine still resolves in full.
    """
    def absent(key: str, message: str) -> None:
        if missing is None:
            raise ConfigError(key, message)
        missing.append(ConfigError(key, message))

    check_generator_options(cfg)
    check_kv_budget(cfg)
    lines = []
    if cfg.model.path:
        if Path(cfg.model.path).exists() and not Path(cfg.model.path).is_dir():
            raise ConfigError("model.path", f"{cfg.model.path} is a file, not a model directory")
        if not Path(cfg.model.path).exists():
            absent("model.path", f"no such directory: {cfg.model.path}")
        lines.append(f"model: {cfg.model.path} ({cfg.model.dtype})")
    else:
        lines.append(f"model: built from model.init ({cfg.model.init.get('model_type')})")
    for key in ("train", "eval"):
        src = getattr(cfg.data, key)
        if src and source_name(src, f"data.{key}") is None and not Path(src).exists():
            absent(f"data.{key}", f"no such file: {src}")
        lines.append(f"data.{key}: {src or '(none)'}")
    if cfg.engine.kind not in ENGINE_KINDS:
        raise ConfigError("engine.kind", f"engine {cfg.engine.kind!r} is not available here")
    if cfg.trainer.kind not in TRAINER_KINDS:
        raise ConfigError("trainer.kind", f"trainer {cfg.trainer.kind!r} is not available here")
    lines.append(f"engine: {cfg.engine.kind}; trainer: {cfg.trainer.kind}; "
                 f"sandbox: {cfg.sandbox.kind}")
    lines += check_task(cfg)  # plugins imported, the task source built: errors name the key
    r = cfg.rollout
    lines.append(f"rollout: {r.prompts_per_step} prompts x {r.samples_per_prompt} samples -> "
                 f"{r.group_size} kept (roc={cfg.roc.kind}/{cfg.roc.positive}), "
                 f"format={r.tool_format}, temperature={r.temperature}")
    for i, st in enumerate(cfg.stages):
        for key, files in (("train", st.chat.train), ("valid", st.chat.valid)) if st.chat else ():
            for f in files:
                if not Path(f).exists():
                    absent(f"stages[{i}].chat.{key}", f"no such file: {f}")
        extra = f", filter=hard(k={st.hard_filter_k})" if st.data_filter == "hard" else ""
        if st.chat is not None:
            extra += f", chat files: {len(st.chat.train)} (layout {st.chat.layout})"
        if st.kind == "distill":
            extra += _distill_plan(i, st.distill or DistillSection(), absent)
        plateau = f", plateau({st.plateau.metric}, {st.plateau.patience})" if st.plateau else ""
        lines.append(f"stage {i} {st.name}: {st.kind}, {st.steps} steps, budget "
                     f"{stage_budget(cfg.rollout, st)}, lr {stage_lr(st, cfg.algorithm.lr)}"
                     f"{extra}{plateau}")
    return lines


def _distill_plan(i: int, d: DistillSection, absent: Callable[[str, str], None]) -> str:
    """A distill stage's line: its rounds and, with a teacher, the teacher and its engine (a
    local teacher's directory must be here)."""
    out = (f", distill {d.rounds} rounds x {d.samples_per_problem} samples, at most "
           f"{d.max_per_problem} kept per problem")
    t = d.teacher
    if t is not None:
        out += f", teacher {t.path} ({t.engine.kind} engine)"
        if t.engine.kind == "local" and not Path(t.path).is_dir():
            absent(f"stages[{i}].distill.teacher.path", f"no such directory: {t.path}")
    return out
