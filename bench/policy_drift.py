"""How far RL moved the policy from its cold start, and where: KL to the cold-start policy by part.

For each RL checkpoint (`RUN/checkpoints/step_*/trainer/trainer.pt`), the exact
KL(pi_cold || pi_step) over the cold start's sampled eval answers, summed per answer and split
by part of the answer (choice, code digits, code other, answer, other), beside the relative
weight change ||w - w_cold|| / ||w_cold|| for the embedding, the attention, the MLPs and the
norms. The measures are `asyncrl/analysis/policy_drift.py`; this script prints them.

    python bench/policy_drift.py COLD_RUN RUN [MORE_RUNS ...] [--max-answers N]

COLD_RUN is the run whose `final/` the RL runs started from (a `bench/roc_ablation.py`
`sft-seed{S}` directory); keep more checkpoints in the RL runs to see the path
(`--set checkpoint.every_steps=5 --set checkpoint.keep_last=20`). Prints a table and writes
`bench/results/policy_drift.json`. A minute or so on a CPU; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.analysis.policy_drift import markdown, measure
from asyncrl.errors import DataError, ModelError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cold", type=Path, help="the cold-start run (its final/ and eval/)")
    ap.add_argument("runs", type=Path, nargs="+", help="RL runs started from COLD/final")
    ap.add_argument("--max-answers", type=int, default=512)
    args = ap.parse_args()
    try:
        n_answers, rows = measure(args.cold, args.runs, args.max_answers)
    except (DataError, ModelError) as e:
        raise SystemExit(str(e)) from None
    print(markdown(rows, n_answers))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "policy_drift.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS / 'policy_drift.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
