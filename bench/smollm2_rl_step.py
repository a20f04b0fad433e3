"""Seconds per RL step on SmolLM2-135M-Instruct: asyncrl against TRL's GRPOTrainer, the same work.

The same model directory, the same P reasoning-gym prompts per step (the curriculum's
`data.generator_options`) (SmolLM2's ChatML with the
curriculum's system text, rendered by the model's template in both), the same group size G
(P x G completions per step, every one trained: `roc.kind = "grpo_all"`, no oversampling),
the same response budget, temperature 1.0, the same outcome reward (the `\\boxed{}` answer equal
to the problem's), one optimizer step per RL step, fp32, the same torch threads.

Without tools, in both: TRL 1.16's GRPOTrainer takes tools only through a chat template that
renders them, and SmolLM2's does not. asyncrl runs as `asyncrl train` on a one-stage config
derived from `curricula/smollm2.toml` (`rollout.tools = false`), timed by its own
`timing/step_s`; TRL by a callback around each optimizer step (generation included).
TRL's `GRPOConfig` turns gradient checkpointing on by default; it is turned off here, as
asyncrl does not recompute either (the same work).
The first step of each is a warm-up and is reported apart.

    python bench/smollm2_rl_step.py --model models/smollm2-135m-instruct [--prompts 4]
        [--group 8] [--new 128] [--steps 3] [--threads 2] [--only asyncrl trl]
        [--micro-batch-tokens 2048]

Prints a table and writes `bench/results/smollm2_rl_step.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
SYSTEM = ("Solve the problem. To run Python, write a ```python block; its output comes back to "
          "you. Give the final answer as <answer>\\boxed{N}</answer>.")


def curriculum_data_options() -> dict[str, Any]:
    import tomllib

    with (ROOT / "curricula" / "smollm2.toml").open("rb") as fp:
        return dict(tomllib.load(fp)["data"]["generator_options"])


def run_asyncrl(args: argparse.Namespace, out: Path) -> list[float]:
    sets = [f"model.path={Path(args.model).resolve()}", "rollout.tools=false",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.group}", f"rollout.group_size={args.group}",
            f"rollout.max_response_tokens={args.new}", "roc.kind=grpo_all",
            "roc.reject_equal_reward=false", f"trainer.threads={args.threads}",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}", "eval.every_steps=0",
            "eval.max_problems=1", "eval.k=1", "eval.greedy=false", "checkpoint.every_steps=0",
            f"run.output_dir={out}", "run.name=asyncrl-rl-step", "algorithm.warmup_steps=0"]
    cfg = out / "rl_step.toml"
    text = (ROOT / "curricula" / "smollm2.toml").read_text()
    head = text[:text.index("[[stages]]")]
    cfg.write_text(head + f'[[stages]]\nname = "rl"\nsteps = {args.steps}\n'
                   f"max_response_tokens = {args.new}\n\n" + text[text.index("[eval]"):])
    run_dir = out / "asyncrl-rl-step"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left there would be renamed around
    cmd = [sys.executable, "-m", "asyncrl", "train", str(cfg), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["timing/step_s"] for r in rows if "timing/step_s" in r]


def run_trl(args: argparse.Namespace, out: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.formats import extract_answer
    from asyncrl.modeling import load_model, load_tokenizer
    from asyncrl.tasks import families as tasks

    torch.set_num_threads(args.threads)
    train, _ = tasks.generate("reasoning_gym", curriculum_data_options(), 0)
    rows = [{"prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": p.question}], "answer": p.answer}
            for p in train[:args.prompts * (args.steps + 1)]]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        got = [extract_answer(c[0]["content"] if isinstance(c, list) else c)
               for c in completions]
        return [1.0 if g is not None and g.strip() == a else 0.0 for g, a in zip(got, answer,
                                                                                   strict=True)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    n = args.prompts * args.group
    cfg = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, bf16=False,
                     num_generations=args.group, per_device_train_batch_size=n,
                     generation_batch_size=n, gradient_accumulation_steps=1,
                     max_completion_length=args.new, temperature=1.0, learning_rate=2e-6,
                     max_steps=args.steps, logging_steps=1, save_strategy="no",
                     report_to="none", shuffle_dataset=False, beta=0.0,
                     dataloader_num_workers=0, gradient_checkpointing=False)
    tok = load_tokenizer(args.model)
    trainer = GRPOTrainer(model=load_model(args.model), reward_funcs=reward, args=cfg,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=["asyncrl", "trl"])
    ap.add_argument("--micro-batch-tokens", type=int, default=2048,
                    help="asyncrl's trainer.micro_batch_tokens (the curriculum's: 2048)")
    args = ap.parse_args()
    # Before torch loads: OpenMP reads it once, and the local engine's and trainer's worker
    # threads get their pool size from it, not from torch.set_num_threads on this thread (with
    # more OpenMP threads than free cores, libgomp's waits cost several times the work).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    out = RESULTS / "smollm2_rl_step_runs"
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"prompts": args.prompts, "group": args.group, "new": args.new,
                           "steps": args.steps, "threads": args.threads,
                           "micro_batch_tokens": args.micro_batch_tokens,
                           "loadavg_start": os.getloadavg()}
    for name in args.only:
        fn = run_asyncrl if name == "asyncrl" else run_trl
        times = fn(args, out)
        res[name] = {"step_s": [round(t, 2) for t in times],
                     "median_after_first_s": round(statistics.median(times[1:] or times), 2)}
        print(name, res[name], flush=True)
    res["loadavg_end"] = os.getloadavg()
    lines = [f"RL step, SmolLM2-135M fp32: {args.prompts} prompts x {args.group} samples, up to "
             f"{args.new} new tokens, no tools, {args.threads} threads; load "
             f"{res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
             "| trainer | first step s | later steps s (median) |", "| --- | --- | --- |"]
    for name in args.only:
        lines.append(f"| {name} | {res[name]['step_s'][0]} | {res[name]['median_after_first_s']} |")
    if {"asyncrl", "trl"} <= set(args.only):
        res["trl_over_asyncrl"] = round(res["trl"]["median_after_first_s"]
                                        / res["asyncrl"]["median_after_first_s"], 2)
        lines.append(f"TRL / asyncrl: {res['trl_over_asyncrl']}x")
    print("\n".join(lines))
    (RESULTS / "smollm2_rl_step.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
