"""How exactly a tiny-math policy copies the question's numbers into its program.

For each problem of an unseen tiny_math set, the prompt is followed by the tool transcript's
opening (`<reason>Compute it with Python.</reason>` and the code fence, as the SFT data and
the rollouts write it); the model decodes the program greedily, and the program is compared
with the problem's solution program. Exact-match rate per level and per question form: a
policy that calls the tool but copies a digit wrong shows here, whether or not it would
choose the tool greedily (the held-out eval mixes the two).

A second measure needs no decoding (`--leak-only` runs it alone, in seconds): the
teacher-forced leak on gold tool transcripts (`asyncrl/analysis/copy_leak.py` defines it), 1 -
p(gold token) summed per transcript by part of the answer, for each execution time shown in the
output (`--tool-times`: a model should not care which).

    python bench/copy_probe.py RUN/final [MORE_DIRS ...] [--levels 1 2 3 4] [--problems 400]
        [--seed-offset 7919] [--system-prompt TEXT] [--tool-times 0.01 0.16] [--leak-only]
        [-v]

Prints one row per model (and one per model and level for the leak) and writes
`bench/results/copy_probe.json`. Minutes on a CPU for the tiny model; not part of the tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import tomllib
from pathlib import Path
from typing import Any

from asyncrl.analysis.answer_parts import CLASSES
from asyncrl.analysis.copy_leak import gold_leak

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def probe(path: Path, levels: list[int], n: int, seed_offset: int, system_prompt: str,
          batch: int = 64) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl import formats
    from asyncrl.sft.coldstart import REASON_TOOL
    from asyncrl.tasks import families as tasks
    from asyncrl.tasks.families import tiny_math

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    fmt = formats.get_format("markdown")
    _, problems = tasks.generate("tiny_math", {"train_size": 1, "eval_size": n, "levels": levels,
                                               "seed_offset": seed_offset}, seed=0)
    opening = REASON_TOOL + "```python\n"
    right: collections.Counter[tuple[int, str]] = collections.Counter()
    seen: collections.Counter[tuple[int, str]] = collections.Counter()
    misses: list[tuple[str, str]] = []
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        texts = [formats.render_prompt(p.question, fmt, [formats.PYTHON_TOOL_SCHEMA],
                                       system_prompt) + opening for p in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=48, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0)
        width = enc["input_ids"].shape[1]
        for p, ids in zip(chunk, out, strict=True):
            code = tok.decode(ids[width:], skip_special_tokens=True).split("```")[0].strip()
            form = next(f.key for f in tiny_math.FORMS if f.match(p.question) is not None)
            key = (int(p.difficulty or 0), form)
            seen[key] += 1
            ok = code == tiny_math.solution_code(p).strip()
            right[key] += ok
            if not ok and len(misses) < 12:
                misses.append((p.question, code))
    by_level: dict[str, float] = {}
    for lv in sorted({k[0] for k in seen}):
        keys = [k for k in seen if k[0] == lv]
        by_level[f"L{lv}"] = sum(right[k] for k in keys) / sum(seen[k] for k in keys)
    by_form = {f"{form}@L{lv}": right[(lv, form)] / seen[(lv, form)]
               for lv, form in sorted(seen)}
    return {"model": str(path), "problems": len(problems), "by_level": by_level,
            "by_form": by_form, "misses": misses}


def leak(path: Path, levels: list[int], n: int, seed_offset: int, system_prompt: str,
         tool_times: list[float]) -> dict[str, Any]:
    """`gold_leak` of the model at `path` for each tool time, keyed `"{level}@{time}s"`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.tasks import families as tasks

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    _, problems = tasks.generate("tiny_math", {"train_size": 1, "eval_size": n, "levels": levels,
                                               "seed_offset": seed_offset}, seed=0)
    out = {}
    for t in tool_times:
        for lv, per in gold_leak(model, tok, problems, system_prompt, t).items():
            out[f"{lv}@{t:.2f}s"] = per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--problems", type=int, default=400)
    ap.add_argument("--seed-offset", type=int, default=7919)
    ap.add_argument("--system-prompt", default=None,
                    help="default: data.system_prompt of curricula/tiny.toml")
    ap.add_argument("--tool-times", type=float, nargs="+", default=[0.01, 0.16],
                    help="execution times shown in the gold outputs (the leak per time)")
    ap.add_argument("--leak-only", action="store_true",
                    help="only the teacher-forced leak on gold transcripts (no decoding)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print some misses")
    args = ap.parse_args()
    system = args.system_prompt
    if system is None:
        cur = tomllib.loads((ROOT / "curricula" / "tiny.toml").read_text())
        system = cur["data"]["system_prompt"]
    rows = []
    for m in args.models:
        r: dict[str, Any] = {"model": str(m)}
        if not args.leak_only:
            r = probe(m, args.levels, args.problems, args.seed_offset, system)
            forms = " ".join(f"{k}={v:.2f}" for k, v in r["by_form"].items())
            print(f"{m}: " + " ".join(f"{k}={v:.2f}" for k, v in r["by_level"].items())
                  + f" | {forms}", flush=True)
            if args.verbose:
                for q, code in r["misses"]:
                    print(f"    {q!r} -> {code!r}")
        r["leak"] = leak(m, args.levels, args.problems, args.seed_offset, system,
                         args.tool_times)
        rows.append(r)
    classes = [*CLASSES, "total"]
    print("\nTeacher-forced leak on gold tool transcripts, sum of 1 - p per transcript:")
    print("| model | level @ tool time | " + " | ".join(classes) + " |")
    print("|---|---|" + "---|" * len(classes))
    for r in rows:
        for lv, per in r["leak"].items():
            print(f"| {r['model']} | {lv} | " + " | ".join(f"{per[c]:.4f}" for c in classes)
                  + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "copy_probe.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {RESULTS / 'copy_probe.json'}")


if __name__ == "__main__":
    main()
