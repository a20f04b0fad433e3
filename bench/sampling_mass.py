"""Where a temperature-1 sample leaves the greedy answer: probability mass off the greedy path.

Per evaluation of each run, the expected number of places a temperature-1 sample departs from
the greedy answer, split by part of the answer (choice, code digits, code other, answer,
other), and where the wrong sampled answers went wrong (head, program, copy, no answer). The
measures and their definitions are `asyncrl/analysis/sampling_mass.py`; this script prints them.
A policy can be 100% right greedily and still lose a fifth of its sampled answers this way: the
figures say which part of the answer to sharpen.

    python bench/sampling_mass.py RUN_DIR [MORE_RUN_DIRS ...] [--last]

Prints one row per evaluation (or per run's last one with `--last`) in each table and writes
`bench/results/sampling_mass.json`. Seconds; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.analysis.answer_parts import CLASSES
from asyncrl.analysis.sampling_mass import MISSES, eval_files, mass, misses

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--last", action="store_true", help="only each run's last evaluation")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    rows = []
    for run in args.runs:
        tok_dir = next((d for d in (run / "final", run / "model-init") if d.is_dir()), None)
        files = eval_files(run)
        if tok_dir is None or not files:
            raise SystemExit(f"{run}: no tokenizer (final/ or model-init/) or no eval/*.jsonl")
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        for f in files[-1:] if args.last else files:
            sampled = f.with_name(f.name.replace("-greedy.jsonl", ".jsonl"))
            rows.append({"run": str(run), **mass(f, tokenizer),
                         "misses": misses(sampled) if sampled != f and sampled.is_file() else None})
    head = ["run", "eval", "greedy right", "tool", *CLASSES, "total", "departing"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = [Path(r["run"]).name, r["eval"], f"{r['greedy_right']:.3f}",
                 f"{r['tool_share']:.2f}", *(f"{r[k]:.3f}" for k in CLASSES),
                 f"{r['total']:.3f}", f"{r['departing_share']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    wrong = [r for r in rows if r["misses"]]
    if wrong:
        head = ["run", "eval", "sampled", "right", *(f"wrong: {k}" for k in MISSES)]
        print("\nWhere the wrong sampled answers went wrong (share of all sampled answers):")
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in wrong:
            m = r["misses"]
            cells = [Path(r["run"]).name, r["eval"], str(m["sampled"]), f"{m['right']:.3f}",
                     *(f"{m[k]:.3f}" for k in MISSES)]
            print("| " + " | ".join(cells) + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sampling_mass.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS / 'sampling_mass.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
