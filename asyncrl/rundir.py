"""Run directories: which directory a `train` invocation writes, and what to tell the user.

Owns: the naming rule (`output_dir/name`, then `name-2`, `name-3`, ... so that a finished run
is never reused or overwritten), what `--resume` and an explicit `--run-dir` pick, and the one
console line that says so, and the removal of a directory a failed start left
(`discard_failed_start`). Does not own: what goes into a run directory (the train loop, the
metrics writer, the report).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig
from asyncrl.errors import CheckpointError

__all__ = ["PROMPT_FILE", "discard_failed_start", "pick_run_dir", "read_prompt", "run_dir_for",
           "write_prompt"]

PROMPT_FILE = "prompt.json"
"""What a run's prompts were rendered with, beside `config.json`: `{"system_prompt": the
system text the runner used, "tools": the tool schemas listed}`. The config alone cannot say
it: a task source brings its own system text and tools (a verifiers taskset), and the text
the run used is that, the format's text and the tool list together
(`asyncrl.tasks.wiring.system_text`). `asyncrl.policy.load_policy` reads it."""


def write_prompt(run_dir: Path, system_prompt: str, tools: list[dict[str, Any]]) -> None:
    """Record the system text and the tool schemas a run renders its prompts with."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PROMPT_FILE).write_text(json.dumps(
        {"system_prompt": system_prompt, "tools": tools}, ensure_ascii=False, indent=1) + "\n")


def read_prompt(run_dir: Path) -> dict[str, Any] | None:
    """`write_prompt`'s record, or None for a run written before it existed."""
    path = run_dir / PROMPT_FILE
    if not path.exists():
        return None
    return dict(json.loads(path.read_text()))


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def _holds_run(d: Path) -> bool:
    return (d / "metrics.jsonl").exists() or (d / "checkpoints").exists()


def discard_failed_start(rd: Path, created: bool) -> bool:
    """After a run failed to start: remove `rd` if this invocation created it and it holds no
    run yet (no metrics, no checkpoint), so the next start takes its name instead of
    `name-N`. True when removed. A directory that existed before is never touched."""
    if not created or not rd.is_dir() or _holds_run(rd):
        return False
    import shutil

    shutil.rmtree(rd, ignore_errors=True)
    return not rd.exists()


def pick_run_dir(cfg: RunConfig, run_dir: str | None, resume: bool) -> tuple[Path, str]:
    """The run directory and a line saying what happens to it (for the console).

    - no `run_dir`, no `resume`: `output_dir/name`; when that already holds a run, the first
      free `output_dir/name-N` (N = 2, 3, ...): a finished run is never reused or overwritten.
    - no `run_dir`, `resume`: the newest of `output_dir/name` and `output_dir/name-N`.
    - `run_dir` given: that directory; without `resume` it must not hold a run yet (metrics or
      checkpoints), with `resume` it must exist.
    Raises `CheckpointError` when the rule cannot be met.
    """
    if run_dir:
        rd = Path(run_dir)
        if resume:
            if not rd.is_dir():
                raise CheckpointError(f"--resume: {rd} does not exist")
            return rd, f"resuming the run in {rd}"
        if _holds_run(rd):
            raise CheckpointError(f"--run-dir {rd} already holds a run: pass --resume to "
                                  "continue it, or choose another directory")
        return rd, f"new run in {rd}"
    base = run_dir_for(cfg)
    mine = re.compile(rf"{re.escape(base.name)}(-\d+)?")  # `tiny2` is another config's run
    siblings = sorted((p for p in base.parent.glob(f"{base.name}*")
                       if p.is_dir() and mine.fullmatch(p.name)),
                      key=lambda p: p.stat().st_mtime)
    if resume:
        if not siblings:
            raise CheckpointError(f"--resume: no run directory {base}* to resume")
        return siblings[-1], f"resuming the newest run of this config, {siblings[-1]}"
    if not base.exists():
        return base, f"new run in {base}"
    n = 2
    while Path(f"{base}-{n}").exists():
        n += 1
    rd = Path(f"{base}-{n}")
    return rd, (f"new run in {rd} ({base} already holds a run; `--resume` continues the "
                "newest one instead)")
