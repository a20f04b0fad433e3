"""Two evaluations of one held-out set, paired by problem (`asyncrl.analysis.paired_eval`).

    python tools/eval_paired.py runs/cold/eval-k8/eval_groups.jsonl runs/rl/eval-k8/eval_groups.jsonl

A is the first file, B the second; either may be a running evaluation's journal
(`eval_groups.jsonl.partial`). One row per problem source and one over all: the problems both
hold, avg@K of each, B - A with its 95% bootstrap interval over the problems, and the share of
tool calls that failed inside correct answers, A -> B.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.analysis.paired_eval import compare, read_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the baseline's eval_groups.jsonl (or its .partial journal)")
    ap.add_argument("b", help="the other evaluation's")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = compare(read_groups(Path(args.a)), read_groups(Path(args.b)))
    print(f"{'source':30} {'problems':>8} {'avg A':>7} {'avg B':>7} {'B - A [95% CI]':>24} "
          f"{'failed calls in correct, A -> B':>32}")
    for source, r in rows.items():
        ci = f"{r['diff']:+.1%} [{r['diff_lo']:+.1%}, {r['diff_hi']:+.1%}]"
        err = f"{r['tool_errors_correct_a']:.1%} -> {r['tool_errors_correct_b']:.1%}"
        print(f"{source[-30:]:30} {int(r['problems']):8d} {r['avg_a']:7.1%} {r['avg_b']:7.1%} "
              f"{ci:>24} {err:>32}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(rows, fp, indent=1)


if __name__ == "__main__":
    main()
