"""Seconds per SFT step of the tiny curriculum's cold start, by `trainer.micro_batch_tokens`.

The SFT stage of `curricula/tiny.toml` (its model, a tokenizer trained on the task corpus as a
run does, its 32-transcript steps with the stage's tool and fail-fix shares) through the real
torch trainer. A step's 32 transcripts run 50-240 tokens; the trainer packs them, longest
first, into micro-batches of at most `micro_batch_tokens` padded tokens (rows x longest row).
With a large budget the whole step is one block padded to its longest row; a small one cuts
the step by length, so less of the compute is padding. The update is the same either way (the
loss is normalised over the whole step), so the only question is time.

Budgets are timed in turns (round-robin, after one warm-up step each) so that a machine's
drift lands on all of them alike; the table gives the median ms per step, the padded tokens
per step, micro-batches per step and the speed-up over the first budget listed.

    python bench/sft_step.py [--budgets 8192 2048 1024 512] [--steps 20] [--rounds 3]
        [--threads 0] [--main-pool] [--busy 1]

Each budget is timed twice: alone ("idle", whatever else the machine runs) and "contended",
beside `--busy` processes of this bench's own that spin on the CPU (each bounded in time and
ended with the bench). A laptop with a browser open, or a shared machine, is the contended
case; libgomp's spin-waiting threads made it 5-10x slower than the idle one there with a
fixed thread count. By default (`--threads 0`) the trainer chooses its thread count by timing
its steps, as a run's does (`asyncrl.trainer.threads.ThreadTuner`); `--threads N` fixes it
(the old behaviour). The contended row's steps follow the idle row's, so its median includes the
steps the tuner takes to notice the busy processes.

`--main-pool` first copies a large tensor on the main thread. That leaves the main thread an
OpenMP worker pool beside the stepping thread's; with more OpenMP threads than cores, libgomp
stops spinning between parallel regions and each step is slower (1.5x on 2 cores). A run did
exactly that until its engine copy was made with one thread (`asyncrl/runtime.py`).

Prints a table and writes `bench/results/sft_step.json`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def sft_batches(steps: int) -> tuple[Any, Any, list[list[tuple[list[int], list[int]]]]]:
    """(curriculum, tokenizer, `steps` batches of (ids, loss mask)) as tiny.toml's SFT stage
    makes them."""
    from asyncrl import formats, modeling
    from asyncrl.sft.coldstart import build_sft_examples, corpus
    from asyncrl.tasks import families as tasks

    cur = tomllib.loads((ROOT / "curricula" / "tiny.toml").read_text())
    opts = cur["data"]["generator_options"]
    train, _ = tasks.generate("tiny_math", opts, seed=0)
    tok = modeling.train_tokenizer(corpus("tiny_math", train, tasks.solution_code, 0),
                                   cur["tokenizer"]["vocab_size"])
    stage = next(s for s in cur["stages"] if s.get("kind") == "sft")
    bs = stage["batch_size"]
    examples = build_sft_examples(
        [train[i % len(train)] for i in range(steps * bs)], formats.get_format("markdown"), tok,
        random.Random(0), code_for=tasks.solution_code,
        tool_fraction_by_level={int(k): v for k, v in stage["tool_fraction_by_level"].items()},
        fail_fix_by_level={int(k): v for k, v in stage["fail_fix_by_level"].items()},
        system_prompt=cur["data"]["system_prompt"])
    pairs = [(e.input_ids, e.loss_mask) for e in examples]
    return cur, tok, [pairs[i:i + bs] for i in range(0, len(pairs), bs)]


def padded(trainer: Any, batch: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(padded tokens, micro-batches) of one step under the trainer's budget."""
    from asyncrl.algo import batching

    plan = trainer.plan(batching.sequences_from_sft(batch))
    return sum(t["input_ids"].numel() for t in map(trainer.tensors, plan)), len(plan)


BUSY_LOOP = ("import os, time\nend = time.monotonic() + {s}\n"
             "while time.monotonic() < end and os.getppid() == {parent}: pass\n")


def busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy, for at most `seconds` and no longer than
    this process lives."""
    code = BUSY_LOOP.format(s=seconds, parent=os.getpid())
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def timed_rounds(trainers: dict[int, Any], batches: list, rounds: int,
                 worker: concurrent.futures.ThreadPoolExecutor) -> dict[int, list[float]]:
    """Seconds of each step, by budget; budgets in turns, `rounds` times."""
    times: dict[int, list[float]] = {b: [] for b in trainers}
    for _ in range(rounds):
        for budget, tr in trainers.items():
            for batch in batches[1:]:
                t0 = time.perf_counter()
                worker.submit(tr.sft_step, batch).result()
                times[budget].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 2048, 1024, 512])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per budget and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads, fixed (0 = the trainer's default: all of torch's "
                         "threads, fewer while other programs want the cores)")
    ap.add_argument("--main-pool", action="store_true",
                    help="first copy a large tensor on the main thread, as a run did before "
                         "asyncrl/runtime.py made the engine's copy with one thread")
    ap.add_argument("--busy", type=int, default=1,
                    help="busy processes beside the contended timing (0 = no contended row)")
    ap.add_argument("--busy-limit-s", type=float, default=900.0,
                    help="the busy processes end by themselves after this long")
    args = ap.parse_args()

    import torch

    from asyncrl import modeling
    from asyncrl.config import AlgorithmSection, TorchTrainerConfig
    from asyncrl.trainer.torch_trainer import TorchTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    cur, tok, batches = sft_batches(args.steps + 1)
    real = statistics.mean(sum(len(ids) for ids, _ in b) for b in batches)
    trainers = {}
    for budget in args.budgets:
        model = modeling.build_model(cur["model"]["init"], tok, seed=0)
        trainers[budget] = TorchTrainer(model, TorchTrainerConfig(micro_batch_tokens=budget,
                                                                  threads=args.threads),
                                        AlgorithmSection(lr=1e-3), pad_token_id=tok.pad_token_id)
    if args.main_pool:
        torch.ones(1 << 20).clone()  # an OpenMP region: the main thread keeps a worker pool
    # Steps run on one worker thread, as a run's trainer does on its executor.
    worker = concurrent.futures.ThreadPoolExecutor(1)
    for tr in trainers.values():
        worker.submit(tr.sft_step, batches[0]).result()  # warm-up
    times = timed_rounds(trainers, batches, args.rounds, worker)
    contended: dict[int, list[float]] = {}
    if args.busy:
        load = os.getloadavg()[0]
        procs = busy(args.busy, args.busy_limit_s)
        try:
            time.sleep(0.5)  # let them start spinning
            contended = timed_rounds(trainers, batches, args.rounds, worker)
        finally:
            for pr in procs:
                pr.kill()
                pr.wait()
    worker.shutdown()

    rows = []
    base = statistics.median(times[args.budgets[0]])
    for budget in args.budgets:
        shape = [padded(trainers[budget], b) for b in batches[1:]]
        med = statistics.median(times[budget])
        busy_ms = statistics.median(contended[budget]) * 1e3 if contended else None
        rows.append({"micro_batch_tokens": budget, "ms_per_step": med * 1e3,
                     "padded_tokens_per_step": statistics.mean(s[0] for s in shape),
                     "real_tokens_per_step": real,
                     "micro_batches_per_step": statistics.mean(s[1] for s in shape),
                     "speedup": base / med, "ms_per_step_contended": busy_ms,
                     "contended_over_idle": busy_ms / (med * 1e3) if busy_ms else None})
    omp = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
           if k in os.environ}
    print(f"tiny.toml SFT steps of {len(batches[0])} transcripts, {real:.0f} real tokens a step, "
          f"torch threads {args.threads or f'tuned (at most {torch.get_num_threads()})'}, "
          f"median of {args.steps * args.rounds}"
          + (", main thread's OpenMP pool kept" if args.main_pool else "")
          + f"; OpenMP env {omp or 'unset'}; load average {os.getloadavg()[0]:.1f}"
          + (f" (before the busy processes: {load:.1f})" if args.busy else ""))
    print(f"{'micro_batch_tokens':>18} {'ms/step':>8} {'padded tok':>10} {'micro-batches':>13} "
          f"{'speed-up':>8}" + (f" {f'busy x{args.busy} ms':>12} {'busy/idle':>9}"
                                 if args.busy else ""))
    for r in rows:
        print(f"{r['micro_batch_tokens']:>18} {r['ms_per_step']:>8.0f} "
              f"{r['padded_tokens_per_step']:>10.0f} {r['micro_batches_per_step']:>13.1f} "
              f"{r['speedup']:>7.2f}x" + (f" {r['ms_per_step_contended']:>12.0f} "
                                           f"{r['contended_over_idle']:>8.2f}x"
                                           if args.busy else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "sft_step.json"
    out.write_text(json.dumps({"threads": args.threads or "tuned", "main_pool": args.main_pool,
                               "busy_processes": args.busy, "openmp_env": omp,
                               "load_average": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
