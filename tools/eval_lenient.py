"""Strict and lenient accuracy of saved evaluation answers (`asyncrl.analysis.lenient`).

    python tools/eval_lenient.py runs/smollm2-shipped/eval/*.jsonl runs/smollm2/eval/*.jsonl

One row per file: the run's own score (its reward: `<answer>\\boxed{N}</answer>` required)
and the last number the response writes, outside tool outputs, against the gold answer.
"""

from __future__ import annotations

import argparse
import json

from asyncrl.analysis.lenient import rescore_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = [{"file": f, **rescore_file(f)} for f in args.files]
    print(f"{'file':60} {'answers':>7} {'strict':>7} {'lenient':>7}")
    for r in rows:
        print(f"{r['file']:60} {int(r['answers']):7d} {r['strict']:7.1%} {r['lenient']:7.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(rows, fp, indent=1)


if __name__ == "__main__":
    main()
