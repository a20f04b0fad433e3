"""Where a temperature-1 sample leaves the greedy answer: probability mass off the greedy path.

Every evaluation of a run writes its greedy answers with each token's log-probability under the
untempered distribution (`eval/*-greedy.jsonl`; a greedy-only run's `eval/*.jsonl`). Along that
path, 1 - p(token) is the chance that a sample at temperature 1 writes something else there;
summed over an answer's model-written tokens it is the expected number of places a sample
departs from the greedy answer (to first order), and the share of samples that depart at all is
about 1 - exp(-sum). Split by where the token sits:

- `choice`: inside `<reason>...</reason>` (answer directly, or call the tool);
- `code digits`: digits inside the program (numbers copied from the question);
- `code other`: the rest of the program (which function, brackets, names);
- `answer`: inside `<answer>...</answer>` (the tool's output copied into the answer);
- `other`: fences, the end token.

A policy can be 100% right greedily and still lose a fifth of its sampled answers this way: the
figures say which part of the answer to sharpen.

A second table says where the *sampled* answers that were wrong went wrong (the evaluation's
`eval/*.jsonl` beside the greedy file), as a share of all sampled answers:

- `head`: no tool call; the answer was written from the model's head;
- `program`: the last call's output is not the right answer (a wrong program, or an error);
- `copy`: the last call printed the right answer and the boxed answer differs from it;
- `no answer`: the last call printed the right answer and nothing was boxed.

    python bench/sampling_mass.py RUN_DIR [MORE_RUN_DIRS ...] [--last]

Prints one row per evaluation (or per run's last one with `--last`) in each table and writes
`bench/results/sampling_mass.json`. Seconds; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CLASSES = ("choice", "code digits", "code other", "answer", "other")
MISSES = ("head", "program", "copy", "no answer")
_SPANS = (("<reason>", "</reason>", "choice"), ("```python", "```", "code"),
          ("<answer>", "</answer>", "answer"))


def classify(pieces: list[str]) -> list[str]:
    """The class of each decoded token of one response (a token belongs to the span its first
    character falls in; a span opens after its opening marker and closes at its end marker)."""
    text = "".join(pieces)
    owner = ["other"] * len(text)
    for start, end, name in _SPANS:
        for m in re.finditer(re.escape(start), text):
            stop = text.find(end, m.end())
            stop = len(text) if stop < 0 else stop
            for i in range(m.end(), stop):
                owner[i] = name
    out, at = [], 0
    for piece in pieces:
        cls = owner[at] if at < len(owner) and piece else "other"
        if cls == "code":
            cls = "code digits" if piece.strip().isdigit() else "code other"
        out.append(cls)
        at += len(piece)
    return out


def eval_files(run: Path) -> list[Path]:
    greedy = sorted(run.glob("eval/*-greedy.jsonl"))
    return greedy or sorted(run.glob("eval/*.jsonl"))


def mass(path: Path, tokenizer: Any) -> dict[str, Any]:
    """Expected departures per greedy answer, per class, over one eval file's answers."""
    totals = dict.fromkeys(CLASSES, 0.0)
    answers = tool = right = 0
    for line in path.read_text().splitlines():
        if not line:
            continue
        group = json.loads(line)
        for r in group["rollouts"]:
            answers += 1
            tool += bool(r.get("tool_calls"))
            right += r.get("reward", 0.0) > 0
            pieces = [tokenizer.decode([t]) for t in r["response_ids"]]
            for lp, kind, mine in zip(r["logprobs"], classify(pieces), r["loss_mask"],
                                      strict=True):
                if mine:
                    totals[kind] += 1.0 - math.exp(lp)
    n = max(answers, 1)
    per = {k: v / n for k, v in totals.items()}
    total = sum(per.values())
    return {"eval": path.stem.removesuffix("-greedy"), "answers": answers,
            "greedy_right": right / n, "tool_share": tool / n, **per, "total": total,
            "departing_share": 1.0 - math.exp(-total)}


def miss_kind(rollout: dict[str, Any], gold: str) -> str | None:
    """Why one sampled answer is wrong (`MISSES`), or None when it is right."""
    if rollout.get("reward", 0.0) > 0:
        return None
    calls = rollout.get("tool_calls") or []
    if not calls:
        return "head"
    if (calls[-1].get("stdout") or "").strip() != gold.strip():
        return "program"
    return "copy" if rollout.get("answer") not in (None, "") else "no answer"


def misses(path: Path) -> dict[str, Any]:
    """Shares of one sampled eval file's answers that are wrong, by why (`miss_kind`)."""
    counts = dict.fromkeys(MISSES, 0)
    answers = 0
    for line in path.read_text().splitlines():
        if not line:
            continue
        group = json.loads(line)
        for r in group["rollouts"]:
            answers += 1
            kind = miss_kind(r, str(group["problem"]["answer"]))
            if kind:
                counts[kind] += 1
    n = max(answers, 1)
    return {"eval": path.stem, "sampled": answers, "right": 1.0 - sum(counts.values()) / n,
            **{k: v / n for k, v in counts.items()}}


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
