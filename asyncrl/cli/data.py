"""`asyncrl data prepare`: public datasets into the project's problem and chat files.

Owns the command's arguments and dispatch; the conversions are `asyncrl.prepare.problems`
(math sets) and `asyncrl.prepare.chat` (chat / function-calling sets).
"""

from __future__ import annotations

import argparse
from typing import Any

CHAT_SETS = ("glaive", "hermes", "toolace", "xlam", "alpaca", "sharegpt", "openai")
"""`asyncrl data prepare` sources converted to chat JSONL (`asyncrl.prepare.chat`)."""


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `asyncrl data prepare`."""
    p.add_argument("source", choices=["dapo", "aime24", "aime25", "math500", *CHAT_SETS],
                   help="which dataset the input rows come from (its column layout): math "
                        "problems (dapo, aime24, aime25, math500) to problem JSONL, or chat / "
                        "function-calling sets (glaive, hermes, toolace, xlam, alpaca, "
                        "sharegpt, openai) to chat JSONL for an SFT stage")
    p.add_argument("-i", "--input", action="append", default=[], metavar="PATH_OR_HUB",
                   help="a local .parquet/.json/.jsonl file in the source's layout, or a hub "
                        "name `owner/name[:config][@split]` (needs `datasets` and network); "
                        "repeatable, rows are concatenated in order; default: the source's hub "
                        "name(s)")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="output JSONL; the summary goes beside it as PATH.summary.json")
    p.add_argument("--keep-non-english", action="store_true",
                   help="dapo: keep problems with Chinese text (default: English subset only)")


def _cmd_prepare(args: argparse.Namespace) -> int:
    if args.source in CHAT_SETS:
        from asyncrl.prepare import chat

        return chat.run(args)
    from asyncrl.prepare import problems

    return problems.run(args)


def register(subparsers: Any) -> None:
    """Add `asyncrl data prepare` to the CLI."""
    p_data = subparsers.add_parser("data", help="prepare datasets")
    data_sub = p_data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p_prep = data_sub.add_parser(
        "prepare", help="convert DAPO-Math-17k / AIME 2024 / AIME 2025 / MATH-500 to problem "
                        "JSONL, or function-calling / instruction / chat sets to chat JSONL")
    add_prepare_arguments(p_prep)
    p_prep.set_defaults(func=_cmd_prepare)
