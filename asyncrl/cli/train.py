"""`asyncrl train CONFIG`: run a curriculum and write its run directory.

Owns the command's arguments, the run directory's choice and the console lines around a run;
the run itself is `asyncrl.train.train_async`. Under torchrun the ranks other than 0 follow
rank 0's trainer calls (`asyncrl.trainer.megatron.launch.follow`) instead of running a loop.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from typing import Any

from asyncrl import config as config_mod
from asyncrl import train
from asyncrl.cli import plan
from asyncrl.errors import ConfigError, RunStopped
from asyncrl.rollout.blocking import describe_stuck
from asyncrl.rollout.eventloop import run as run_loop
from asyncrl.rundir import discard_failed_start, pick_run_dir


def cmd_train(args: Any) -> int:
    cfg = config_mod.load(args.config, args.set)
    if int(os.environ.get("RANK", "0")) != 0 and not args.dry_run:
        # Under torchrun only rank 0 runs the event loop; the others serve its trainer calls.
        if cfg.trainer.kind != "megatron":
            raise ConfigError("trainer.kind", "multi-process runs need trainer.kind = "
                              "\"megatron\" (or torch with its own torchrun launch)")
        from asyncrl.trainer.megatron.launch import follow

        follow()
        return 0
    if args.dry_run:
        return _dry_run(cfg)
    from asyncrl.policy import check_kv_budget
    from asyncrl.tasks.check import check_generator_options

    check_generator_options(cfg)  # a bad generator option or budget fails here, naming its key
    check_kv_budget(cfg)
    rd, note = pick_run_dir(cfg, args.run_dir, args.resume)
    print(f"asyncrl: {note}", file=sys.stderr)
    again = resume_command(args.config, rd, args.set)
    created = not rd.exists()
    try:
        return _run(cfg, args, rd, again, created)
    finally:
        stuck = describe_stuck()
        if stuck:  # the run ended; what hung is not waited for, but a person should know
            print(f"asyncrl: warning: {stuck}", file=sys.stderr)


def _run(cfg: Any, args: Any, rd: Any, again: str, created: bool) -> int:
    try:
        rd = run_loop(train.train_async(cfg, resume=args.resume, run_dir=str(rd),
                                        resume_command=again))
    except RunStopped as e:
        print(f"asyncrl: stopped by {e.signal_name or 'request'} after {e.where or 'startup'}."
              f" {train.stop_summary(rd, again)}", file=sys.stderr)
        num = signal.Signals.__members__.get(e.signal_name, signal.SIGINT)
        return 128 + int(num)  # 130 for SIGINT, 143 for SIGTERM: what a shell expects
    except Exception:  # a start that failed before its first step leaves no directory
        if discard_failed_start(rd, created):  # the next start takes this name again
            print(f"asyncrl: the run did not start; removed {rd}", file=sys.stderr)
        raise
    print(f"run directory: {rd}")
    print(f"report: {rd / 'report' / 'summary.md'}; trajectory viewer: "
          f"{rd / 'report' / 'viewer.html'} (open it in a browser)")
    return 0


def resume_command(config: str, run_dir: Any, sets: list[str]) -> str:
    """The exact command that continues this run (printed when it stops)."""
    parts = ["asyncrl", "train", config, "--run-dir", str(run_dir), "--resume"]
    for kv in sets:
        parts += ["--set", kv]
    return shlex.join(parts)


def _dry_run(cfg: Any) -> int:
    """Print the resolved plan. A recipe is often checked on a machine other than the one it
    runs on (rstar2.toml's model and data live on the cluster), so paths missing here are
    warnings, each naming its key; an unknown component or a bad value still fails."""
    missing: list[ConfigError] = []
    for line in plan.dry_run(cfg, missing=missing):
        print(line)
    for err in missing:
        print(f"warning: {err} (a real run needs it)")
    if missing:
        print(f"dry run: ok, with {len(missing)} path(s) missing on this machine")
    else:
        print("dry run: ok")
    return 0


TRAIN_EPILOG = """\
run directory (output_dir/name, or --run-dir):
  config.json      the resolved config        metrics.jsonl  one JSON row per step/eval
  log.jsonl        every log event as JSON    checkpoints/   resumable state (--resume)
  eval/            every eval rollout         rollouts/      RL waves (logging.rollouts_every)
  tensorboard/, wandb/   when logging.sinks = ["tensorboard", "wandb"]
  model-init/      the built model and tokenizer (runs without model.path)
  final/           the trained model (a Hugging Face directory)
  report/          summary.md, PNG plots and viewer.html, the trajectory viewer: every
                   rollout's turns, tool calls, reward and RoC decision, filterable (rebuild
                   it any time with `asyncrl report RUN_DIR`)

A second run of the same config starts a new numbered directory (name-2, name-3, ...) and says
so; it never reuses or overwrites a finished run. Ctrl-C or SIGTERM stops a run safely: the
last completed step is saved and the console prints the --resume command (docs/reliability.md). On a terminal a live progress display shows
the stage, step, reward, held-out accuracy, rollouts, tool calls and ETA (logging.progress).
"""


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="run a curriculum (SFT cold start, GRPO-RoC stages); "
                                     "writes a run directory with a report and viewer",
                       description="Run a curriculum: SFT cold start, then GRPO-RoC stages, "
                                   "with evals and checkpoints,\na live progress display on a "
                                   "terminal, and a report with a trajectory viewer at the end.",
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="curriculum TOML, e.g. curricula/tiny.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue a run from its latest checkpoint: the newest run of this "
                        "config (output_dir/name or name-N), or --run-dir's")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: output_dir/name, or the next free name-N); "
                        "without --resume it must not hold a run already")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve stages, data and components without starting anything; "
                        "paths missing on this machine are warnings")
    p.set_defaults(func=cmd_train)
