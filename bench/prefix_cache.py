"""The local engine's continuation cache (`engine.prefix_cache_tokens`) on a real evaluation.

Runs `asyncrl eval CONFIG --checkpoint CKPT` twice in one invocation, each in its own process
on the same problems, seeds and settings: without the cache (`prefix_cache_tokens = 0`, every
turn after a tool call prefilled from the start, what the engine did before) and with it.
Multi-turn answers (program, its output, the answer) are the case it is for: the word-problem
curriculum's cold start calls Python about once per answer.

Reports each arm's evaluation seconds (the eval's own clock, model load excluded), answers,
generated tokens, the cache's hits and reused tokens (the engine's `engine_prefix_cache` log
line), greedy accuracy and avg@k, and how many greedy answers are token for token the same in
both arms, whole and in their model-written tokens (the sandbox's reply carries the run's wall
time, "Time: 0.01s", so a whole answer may differ after a tool call in any two runs; a
continuation's prefill computes the same numbers in another order, so an fp32 near-tie may
also flip; a real difference would show as many). Prints a table, writes
`bench/results/prefix_cache[-TAG].json`.

    python bench/prefix_cache.py --config curricula/smollm2-word.toml \\
        --checkpoint DIR [--max-problems 32] [--k 4] [--temperature 1] [--tokens 32768]
        [--tag NAME]

Minutes per arm on 2 cores with SmolLM2; run it alone (the JSON keeps the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

HITS = re.compile(r"engine_prefix_cache\s.*?hits=(\d+).*?reused_tokens=(\d+)")


def run_arm(config: str, checkpoint: str, tokens: int, max_problems: int, k: int,
            temperature: float, out: Path, sets: list[str]) -> dict[str, Any]:
    """One `asyncrl eval` with `engine.prefix_cache_tokens = tokens`: its eval.json figures,
    the greedy answers' token ids by problem, and the cache's last reported counts."""
    argv = [sys.executable, "-m", "asyncrl.cli.main", "eval", config, "--checkpoint", checkpoint,
            "--max-problems", str(max_problems), "--k", str(k), "--temperature", str(temperature),
            "--greedy", "--out", str(out), "--set", f"engine.prefix_cache_tokens={tokens}",
            "--set", "logging.console=plain"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"asyncrl eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "eval.json").read_text())
    greedy: dict[str, list[int]] = {}
    model_tokens: dict[str, list[int]] = {}
    generated = 0
    for name in ("eval_groups.jsonl", "eval_groups_greedy.jsonl"):
        for line in (out / name).read_text().splitlines():
            g = json.loads(line)
            for r in g["rollouts"]:
                generated += sum(r.get("loss_mask") or [])
                if name.endswith("greedy.jsonl"):
                    pid = g["problem"]["id"]
                    greedy[pid] = r["response_ids"]
                    model_tokens[pid] = [t for t, m in zip(r["response_ids"], r["loss_mask"],
                                                           strict=True) if m]
    found = HITS.findall(proc.stdout + proc.stderr)
    hits, reused = (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)
    return dict(tokens=tokens, seconds=summary["seconds"], wall_s=round(wall, 1),
                accuracy=summary.get("accuracy"), avg_at_k=summary.get(f"avg@{k}"),
                generated_tokens=generated, hits=hits, reused_tokens=reused, greedy=greedy,
                model_tokens=model_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "curricula" / "smollm2-word.toml"))
    p.add_argument("--checkpoint", required=True, help="an HF model directory")
    p.add_argument("--max-problems", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="of the k sampled answers (the curriculum evaluates greedy only)")
    p.add_argument("--tokens", type=int, default=32768, help="the cache arm's budget")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    load_before = os.getloadavg()
    arms = {}
    with tempfile.TemporaryDirectory(prefix="prefix_cache-") as tmp:
        for name, tokens in (("off", 0), ("on", a.tokens)):
            arms[name] = run_arm(a.config, a.checkpoint, tokens, a.max_problems, a.k,
                                 a.temperature, Path(tmp) / name, a.sets)
    load_after = os.getloadavg()
    off, on = arms["off"], arms["on"]
    same = sum(off["greedy"].get(pid) == ids for pid, ids in on["greedy"].items())
    same_model = sum(off["model_tokens"].get(pid) == ids
                     for pid, ids in on["model_tokens"].items())
    print(f"{'arm':<6} {'eval s':>8} {'answers tok':>11} {'tok/s':>7} {'hits':>6} "
          f"{'reused tok':>10} {'greedy':>7} {'avg@k':>7}")
    for name, r in arms.items():
        print(f"{name:<6} {r['seconds']:>8.1f} {r['generated_tokens']:>11} "
              f"{r['generated_tokens'] / r['seconds']:>7.1f} {r['hits']:>6} "
              f"{r['reused_tokens']:>10} {r['accuracy']:>7.3f} {r['avg_at_k']:>7.3f}")
    speedup = off["seconds"] / on["seconds"]
    print(f"speed-up {speedup:.2f}x; greedy answers the same token for token: {same} of "
          f"{len(on['greedy'])}, their model-written tokens: {same_model}; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    name = "prefix_cache" + (f"-{a.tag}" if a.tag else "") + ".json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    answers = len(on["greedy"])
    for r in arms.values():
        r.pop("greedy")
        r.pop("model_tokens")
    (RESULTS / name).write_text(json.dumps(dict(
        config=a.config, checkpoint=a.checkpoint, max_problems=a.max_problems, k=a.k,
        temperature=a.temperature, sets=a.sets, time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        arms=arms, speedup=speedup,
        greedy_same=same, greedy_model_tokens_same=same_model, greedy_answers=answers,
        load_average_before=load_before,
        load_average_after=load_after), indent=1))
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
