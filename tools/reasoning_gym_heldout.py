"""Held-out problems from a source no one here wrote: reasoning-gym's arithmetic generators.

Writes a problem JSONL file (`id`, `question`, `answer`, `difficulty`) that a curriculum's
`data.eval` (or `asyncrl eval --data`) reads, from reasoning-gym's `basic_arithmetic`,
`chain_sum` and `products` generators at a seed far from anything a run trains on (the
default 1_000_003; the curricula train on asyncrl's own `tiny_math` generator). Each question
gets the instruction to box the answer, as the curriculum's prompt asks.

    pip install reasoning-gym
    python tools/reasoning_gym_heldout.py -o data/rg-heldout.jsonl [--per-task 32] [--seed 1000003]

A stopgap until the reasoning-gym task source (issue 44) lands: it only writes a file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = {  # reasoning-gym dataset -> (level, options): small numbers, as tiny_math's levels 1-3
    "chain_sum": (1, {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 3}),
    "products": (2, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 3}),
    "basic_arithmetic": (3, {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--per-task", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1_000_003)
    args = ap.parse_args()
    import reasoning_gym

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w", encoding="utf-8") as fp:
        for name, (level, opts) in TASKS.items():
            ds = reasoning_gym.create_dataset(name, size=args.per_task, seed=args.seed, **opts)
            for i, item in enumerate(ds):
                row = {"id": f"rg-{name}-{args.seed}-{i}", "question": item["question"],
                       "answer": str(item["answer"]), "difficulty": level}
                fp.write(json.dumps(row) + "\n")
                n += 1
    print(f"wrote {n} problems to {out}")


if __name__ == "__main__":
    main()
