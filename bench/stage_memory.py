"""Peak resident memory of a curriculum run, by stage and phase.

Runs `asyncrl train CONFIG` cut short (each SFT stage `--sft-steps` steps, each RL stage
`--rl-steps`, the evaluations on `--eval-problems` problems, a checkpoint after every step) in a
child process whose phases are marked: the methods that bound them are wrapped, nothing else
changes. A thread in the child reads `/proc/self/status` every `--interval` seconds (and at
every phase boundary): `VmRSS` (resident now) and `VmHWM` (the process's high-water mark, what
`/usr/bin/time -v` reports as "Maximum resident set size").

Phases (innermost wins; a nested one is named by its path, `rl/rollout`):
- `sft` (the SFT stage: transcripts, sandbox runs) and `sft/sft_step` (one optimizer step);
- `rl` (the RL stage's own work), `rl/rollout` (waiting for a wave of rollouts),
  `rl/rl_update` (the trainer's step), `.../weight_sync` (trainer -> engine);
- `evaluation` (k sampled and one greedy answer per problem), `checkpoint`, `final_export`;
- `startup` (model, engine, sandbox, data) and `other` (between the rest).

Per phase: calls, seconds, RSS on entering the first call, the highest RSS sampled inside, how
far the process's high-water mark rose inside (the phase that sets the run's peak is the one
with a positive figure last), and RSS on leaving the last call. The child's peak is also read
by the parent from `getrusage(RUSAGE_CHILDREN)` (the same figure as `/usr/bin/time -v`).

`--code DIR` runs another checkout's `asyncrl` (a worktree of main, for the figures before a
change) under the same marks and cut, from that directory (pass its curriculum as `--config`
for its own settings; a relative `model.path` is read from there). `--env KEY=VALUE` sets the child's environment (for example `MALLOC_ARENA_MAX=2`, to compare
allocator settings), `--set` passes overrides to the run. The run directory is a temporary one
unless `--run-dir`. The load average before and after goes in the JSON (a shared machine's
figures are only comparable at a similar load).

    python bench/stage_memory.py [--config curricula/smollm2.toml] [--sft-steps 4]
        [--rl-steps 2] [--eval-problems 16] [--env K=V] [--set K=V] [--tag NAME]

`--full` runs the curriculum as written, no cut (its own steps, evaluations and checkpoints),
with the same marks: one measured run gives the phases' peaks and the run's learning figures
(its `metrics.jsonl`, `eval/` in `--run-dir`).

Prints a table and writes `bench/results/stage_memory[-TAG].json` (with an RSS timeline, one
point a second). Needs the curriculum's model (`docs/real-models.md` imports SmolLM2); minutes
on 2 cores, so it is not in `run.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# (module, class, method, phase name, async?): the methods whose calls bound a phase.
MARKS = [
    ("asyncrl.train", "StageRunner", "_run_sft", "sft", True),
    ("asyncrl.train", "StageRunner", "_run_rl", "rl", True),
    ("asyncrl.train", "StageRunner", "evaluate", "evaluation", True),
    ("asyncrl.train", "StageRunner", "_sync", "weight_sync", True),
    ("asyncrl.train", "StageRunner", "_checkpoint", "checkpoint", True),
    ("asyncrl.rollout.producer", "RolloutProducer", "take", "rollout", True),
    ("asyncrl.trainer.torch_trainer", "TorchTrainer", "sft_step", "sft_step", False),
    ("asyncrl.trainer.torch_trainer", "TorchTrainer", "train_step", "rl_update", False),
]

CHILD = r"""
import functools, importlib, json, os, sys, threading, time
sys.path.insert(0, {root!r})
MARKS, OUT, INTERVAL = {marks!r}, {out!r}, {interval!r}
stack, samples, calls = [], [], {{}}
started = False
lock = threading.Lock()

def status():
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm

def phase():
    if stack:
        return "/".join(stack)
    return "other" if started else "startup"

def sample():
    rss, hwm = status()
    with lock:
        samples.append((time.monotonic(), rss, hwm, phase()))

def enter(name):
    global started
    sample()
    with lock:
        started = True
        stack.append(name)
        key = "/".join(stack)
        c = calls.setdefault(key, [0, 0.0])
        c[0] += 1
    sample()
    return key, time.monotonic()

def leave(key, t0):
    sample()
    with lock:
        calls[key][1] += time.monotonic() - t0
        stack.pop()
    sample()

def wrap(mod, cls, meth, name, is_async):
    owner = getattr(importlib.import_module(mod), cls)
    fn = getattr(owner, meth)  # AttributeError: the code moved, the bench must follow
    if is_async:
        @functools.wraps(fn)
        async def marked(*a, **k):
            key, t0 = enter(name)
            try:
                return await fn(*a, **k)
            finally:
                leave(key, t0)
    else:
        @functools.wraps(fn)
        def marked(*a, **k):
            key, t0 = enter(name)
            try:
                return fn(*a, **k)
            finally:
                leave(key, t0)
    setattr(owner, meth, marked)

def sampler():
    while True:
        sample()
        time.sleep(INTERVAL)

threading.Thread(target=sampler, daemon=True).start()
for m in MARKS:
    wrap(*m)
from asyncrl.trainer.torch_trainer import TorchTrainer
_export = TorchTrainer.export_hf
def export_marked(self, path, *a, **k):  # the run's final/ export is not a weight sync
    final = os.path.basename(str(path)) == "final" and not stack
    key, t0 = enter("final_export" if final else "export")
    try:
        return _export(self, path, *a, **k)
    finally:
        leave(key, t0)
TorchTrainer.export_hf = export_marked
from asyncrl.cli.main import main
rc = 1
try:
    rc = main(sys.argv[1:])
finally:
    sample()
    with lock:
        data = dict(rc=rc, samples=samples, calls=calls)
    with open(OUT, "w") as f:
        json.dump(data, f)
sys.exit(rc)
"""


def cut_overrides(config: Path, sft_steps: int, rl_steps: int, eval_problems: int
                  ) -> list[str]:
    """`--set` overrides that cut every stage of `config` to a few steps (stage kinds read from
    the TOML: `kind = "sft"`, anything else RL), with checkpoints after every step."""
    with open(config, "rb") as f:
        cfg = tomllib.load(f)
    out = []
    for i, stage in enumerate(cfg.get("stages", [])):
        n = sft_steps if stage.get("kind") == "sft" else rl_steps
        out.append(f"stages.{i}.steps={n}")
        if stage.get("lr_decay_steps"):
            out.append(f"stages.{i}.lr_decay_steps={min(n, int(stage['lr_decay_steps']))}")
    out += [f"eval.max_problems={eval_problems}", "checkpoint.every_steps=1",
            f"checkpoint.sft_every_steps={max(1, sft_steps // 2)}", "logging.console=plain"]
    return out


def phase_rows(samples: list[list[Any]], calls: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per phase: calls, seconds, RSS in and out, the highest RSS sampled, and the rise of the
    high-water mark while it ran (bytes), in order of first appearance."""
    rows: dict[str, dict[str, Any]] = {}
    prev_hwm = 0
    for _t, rss, hwm, ph in samples:
        r = rows.setdefault(ph, dict(phase=ph, rss_in=rss, peak_rss=0, hwm_rise=0, rss_out=rss,
                                     peak_hwm_after=0))
        r["peak_rss"] = max(r["peak_rss"], rss)
        r["rss_out"] = rss
        if hwm > prev_hwm:
            r["hwm_rise"] += hwm - prev_hwm
            r["peak_hwm_after"] = hwm
            prev_hwm = hwm
    for r in rows.values():
        n, s = calls.get(r["phase"], (0, 0.0))
        r["calls"], r["seconds"] = int(n), round(float(s), 2)
    return list(rows.values())


def timeline(samples: list[list[Any]], step: float = 1.0) -> list[list[Any]]:
    """[seconds, RSS bytes, phase] at most one point per `step` seconds (each point the
    highest RSS of its window)."""
    if not samples:
        return []
    t0 = samples[0][0]
    out: list[list[Any]] = []
    for t, rss, _hwm, ph in samples:
        x = round((t - t0) // step * step, 1)
        if out and out[-1][0] == x:
            if rss > out[-1][1]:
                out[-1][1:] = [rss, ph]
        else:
            out.append([x, rss, ph])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "curricula" / "smollm2.toml"))
    p.add_argument("--code", default=str(ROOT), help="the checkout whose asyncrl runs")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--rl-steps", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=16)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--full", action="store_true",
                   help="no cut: the curriculum's own steps, evaluations and checkpoints")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    config = Path(a.config).resolve()
    cut = [] if a.full else cut_overrides(config, a.sft_steps, a.rl_steps, a.eval_problems)
    sets = cut + a.sets
    env = dict(os.environ)
    code_root = Path(a.code).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(code_root), env.get("PYTHONPATH", "")]
                                        ).rstrip(os.pathsep)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    with tempfile.TemporaryDirectory(prefix="stage_memory-") as tmp:
        run_dir = a.run_dir or str(Path(tmp) / "run")
        record = Path(tmp) / "record.json"
        code = CHILD.format(root=str(code_root), marks=MARKS, out=str(record),
                            interval=a.interval)
        argv = ["train", str(config), "--run-dir", run_dir]
        for s in sets:
            argv += ["--set", s]
        load_before = os.getloadavg()
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=str(code_root))
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
        child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        if not record.exists():
            sys.exit(f"the run wrote no record (exit status {proc.returncode})")
        data = json.loads(record.read_text())
    if proc.returncode != 0:  # a stopped run's phases are still its figures, up to the stop
        print(f"the run ended with exit status {proc.returncode}: phases up to there")
    rows = phase_rows(data["samples"], data["calls"])
    peak = max(s[2] for s in data["samples"])
    gib = 2 ** 30
    print(f"{'phase':<26} {'calls':>5} {'s':>7} {'RSS in':>7} {'peak':>7} {'HWM +':>7} "
          f"{'RSS out':>7}   (GiB)")
    for r in rows:
        print(f"{r['phase']:<26} {r['calls']:>5} {r['seconds']:>7.1f} {r['rss_in'] / gib:>7.2f} "
              f"{r['peak_rss'] / gib:>7.2f} {r['hwm_rise'] / gib:>7.2f} {r['rss_out'] / gib:>7.2f}")
    print(f"peak RSS {peak / gib:.2f} GiB (VmHWM; getrusage of the child "
          f"{child_peak / gib:.2f} GiB), {wall:.0f} s, load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    name = "stage_memory" + (f"-{a.tag}" if a.tag else "") + ".json"
    out_path = Path(a.out) if a.out else RESULTS / name
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(dict(
        config=str(config), code=str(code_root), overrides=sets, env=a.env, tag=a.tag,
        exit_status=proc.returncode,
        time=time.strftime("%Y-%m-%dT%H:%M:%S"), wall_s=round(wall, 1),
        load_average_before=load_before, load_average_after=load_after,
        peak_rss_bytes=peak, child_maxrss_bytes=child_peak, phases=rows,
        timeline=timeline(data["samples"])), indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
