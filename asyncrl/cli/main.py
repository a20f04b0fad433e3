"""The `asyncrl` command line: the parser, dispatch, and an error's exit code.

Owns: the top-level parser and the list of commands (each registered by its module in
`asyncrl.cli`: `train`, `eval`, `data`, `model`, and here `config`, `report`, `sandbox`), dispatch, and
mapping errors to exit codes. The commands' bodies import the library lazily so
`asyncrl --help` stays fast and torch is not loaded for commands that do not need it.
A user error (bad config, missing file) prints one clear line and exits 2; it never shows a
traceback. `asyncrl train` stopped by SIGINT / SIGTERM saves its last completed step and exits
128 + the signal (130, 143; `asyncrl.cli.train`); a Ctrl-C outside a run prints `interrupted`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl import __version__
from asyncrl.errors import AsyncRLError, ConfigError

TASK_LINES = ("task source", "reward:", "tools:", "text environment:")


def _cmd_config_check(args: argparse.Namespace) -> int:
    from asyncrl import config
    from asyncrl.cli.plan import dry_run

    cfg = config.load(args.config, args.set)
    sys.stdout.write(config.dump_json(cfg).decode() + "\n")
    # The file is valid; whether its paths exist is a fact of this machine (a cluster recipe
    # is checked on a laptop): each missing one said, as `train --dry-run` says it, and an
    # error only under --strict. An unknown component or a bad value fails either way.
    missing: list[ConfigError] = []
    for line in dry_run(cfg, missing=missing):
        if line.startswith(TASK_LINES):  # what the run trains on, as the dry run says it
            print(line, file=sys.stderr)
    for e in missing:
        print(f"{'error' if args.strict else 'warning'}: {e} (missing on this machine; a real "
              "run needs it)", file=sys.stderr)
    if missing and args.strict:
        return 2
    print(f"ok: {args.config} is valid ({len(cfg.stages)} stages)", file=sys.stderr)
    return 0


_EPILOG = """\
start here:
  asyncrl train curricula/tiny.toml     the whole pipeline on a CPU in minutes; a live progress
                                        display on a terminal; writes runs/tiny (or tiny-N)
  asyncrl report RUN_DIR                RUN_DIR/report/: summary.md, PNG plots and viewer.html,
                                        the trajectory viewer (open it in a browser: every saved
                                        rollout's turns, tool calls, reward, RoC decision)
metrics also go to TensorBoard or W&B with [logging] sinks = ["tensorboard", "wandb"].
`asyncrl COMMAND --help` describes each command.
"""


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set rollout.group_size=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Agentic RL with a Python tool: GRPO-RoC, async multi-turn rollouts, sandbox.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p_config = sub.add_parser("config", help="inspect run configs")
    config_sub = p_config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    p_check = config_sub.add_parser("check", help="validate a config and print it resolved")
    p_check.add_argument("config", metavar="file")
    p_check.add_argument("--strict", action="store_true",
                         help="also fail when `train --dry-run` would (missing model or data "
                              "paths, components not installed here)")
    _add_set(p_check)
    p_check.set_defaults(func=_cmd_config_check)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


# Commands contributed by other modules: each is `register(subparsers)` adding its parser with
# `set_defaults(func=...)`. Listed here (not discovered) so the CLI surface is visible in one place.
def _extra_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    from asyncrl.cli import data, eval, model, train

    return [train.register, eval.register, _register_report, data.register, model.register,
            _register_sandbox]


def _register_sandbox(sub: argparse._SubParsersAction) -> None:
    from sandbox.cli import add_serve_arguments, run_serve

    p = sub.add_parser("sandbox", help="the code-execution service")
    ssub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND")
    serve = ssub.add_parser("serve", help="serve the sandbox pool over HTTP")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)


def _cmd_report(args: argparse.Namespace) -> int:
    from asyncrl.observe.report import write_report

    path = write_report(Path(args.run_dir))
    print(path)
    print(path.parent / "viewer.html")
    return 0


def _register_report(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="write plots, a Markdown summary and the "
                                             "trajectory viewer (viewer.html) of a run",
                              description="Read RUN_DIR/metrics.jsonl and the saved rollouts and "
                                          "write RUN_DIR/report/: PNG plots, summary.md, and "
                                          "viewer.html, a self-contained page (no server, no "
                                          "network) with the plots and a browsable table of "
                                          "every saved rollout per eval and RL step: prompt, "
                                          "turns, tool calls with code, status and output, "
                                          "reward, RoC's decision; filterable by correct, "
                                          "wrong, tool error.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    p.set_defaults(func=_cmd_report)


_EXTRA_COMMANDS = _extra_commands()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.command is None else 2
    from asyncrl import allocator
    from asyncrl import log as logmod

    allocator.configure()  # large blocks mapped on their own: freed memory leaves the process
    # The command is the host here: its log lines go to stderr, readable on a terminal
    # (`train` and `eval` configure again once the run directory is known).
    logmod.configure()
    config = getattr(args, "config", None)
    if isinstance(config, str) and config.endswith(".toml"):
        # A plugin module beside the curriculum imports from any directory (after the working
        # directory, which `asyncrl.tasks.plugins` puts first).
        from asyncrl.tasks.plugins import add_curriculum_dir

        add_curriculum_dir(config)
    try:
        return int(func(args) or 0)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except AsyncRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `asyncrl` command as a process: `main`, then an exit that skips the interpreter's
    last full collection. With torch and transformers loaded that collection alone held a
    finished tiny run's process open 2.6 s (0.35 s frozen); the objects it would have scanned
    die with the process, and everything the run keeps was written and closed before."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
