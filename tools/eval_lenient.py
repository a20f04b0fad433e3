"""Strict and lenient accuracy of saved evaluation answers (`asyncrl.analysis.lenient`).

    python tools/eval_lenient.py runs/smollm2-shipped/eval/*.jsonl runs/smollm2/eval/*.jsonl

One row per file: the run's own score (its reward: `<answer>\\boxed{N}</answer>` required)
and the last number the response writes, outside tool outputs, against the gold answer, with
the tool calls per answer and the share of them that failed. `--by-source` adds a row per
problem source (each reasoning-gym generator) under each file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.analysis.lenient import rescore_by_source
from asyncrl.records import Group, read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--by-source", action="store_true", help="a row per problem source too")
    args = ap.parse_args()
    rows = []
    for f in args.files:
        for source, r in rescore_by_source(read_jsonl(Path(f), Group)).items():
            if source == "all" or args.by_source:
                rows.append({"file": f, "source": source, **r})
    print(f"{'file':52} {'source':30} {'answers':>7} {'strict':>7} {'lenient':>7} "
          f"{'calls/ans':>9} {'call err':>8}")
    for r in rows:
        print(f"{r['file'][-52:]:52} {r['source'][-30:]:30} {int(r['answers']):7d} "
              f"{r['strict']:7.1%} {r['lenient']:7.1%} {r['tool_calls']:9.2f} "
              f"{r['tool_errors']:8.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(rows, fp, indent=1)


if __name__ == "__main__":
    main()
