"""The GPU sweep's plan (`bench/gpu_sweep.py`): each check's command, its bar, how it is read.

Owns the list of checks (the sweep runs the lead ones first, then the cheapest first) and for
each: the command on a
GPU and its twin for `--dry-run` (the same entry point with the same options, tiny values, on
the CPU), the seconds it is expected to take (what the sweep's budget is charged before it
starts), the bar it is judged against (issue 47; docs/gpu.md) and the reader that turns what
it wrote into figures and a verdict. Not the running: the order, budget, timeouts, the table
and the JSON are the sweep's.

Every command is an existing entry point (`pytest`, a `bench/` script, `asyncrl train`) run as
its own process; a check writes only under its own folder (`Ctx.dir`). The GPU estimates come
from the figures of 2026-11-22 (docs/gpu.md); replace them with a sweep's own `wall_s` once one
has run.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = "curricula/tiny.toml"


@dataclass(frozen=True)
class Ctx:
    """What a check's command and reader see."""

    dry: bool  # the CPU twin with tiny shapes
    dir: Path  # this check's own folder (emptied by the sweep before it runs)
    out: Path  # the sweep's folder: another check's folder is `out / name`
    python: str  # the interpreter every command runs under
    cpus: int


@dataclass(frozen=True)
class Reading:
    """A check's figures, and whether they meet its bar (None: no bar of its own, or a figure
    the bar needs is missing, e.g. MFU on a CPU)."""

    figures: dict[str, Any]
    met: bool | None
    note: str  # one line for the table


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    bar: str
    estimate_s: float  # what the budget is charged: the wall seconds of the H200 sweep of
                       # 2026-11-27 (docs/gpu.md), rounded up
    dry_estimate_s: float  # the dry run on 2 quiet CPU cores
    command: Callable[[Ctx], list[str]]
    read: Callable[[Ctx], Reading]
    needs: tuple[str, ...] = ()  # checks whose output this one uses: it runs only after they pass
    ok_returncodes: tuple[int, ...] = (0,)
    cap_s: float = 0.0  # its own timeout on the GPU (0: 2.5 x the estimate)
    lead: bool = False  # runs before the cheaper checks of its call (declared order among
                        # leads): a bar never measured yet is not starved by overrunning ones


def _sets(pairs: list[str]) -> list[str]:
    return [a for kv in pairs for a in ("--set", kv)]


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


# ------------------------------------------------------------------------------- pytest -m gpu
def pytest_cmd(ctx: Ctx) -> list[str]:
    # collection errors (a module importing what the machine lacks) are counted, not fatal
    return [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", f"--junitxml={ctx.dir / 'junit.xml'}"]


def pytest_read(ctx: Ctx) -> Reading:
    root = ET.parse(ctx.dir / "junit.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors",
                                                           "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    bad = [f"{c.get('classname', '')}.{c.get('name', '')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    figures = {"passed": passed, "failed": n["failures"], "errors": n["errors"],
               "skipped": n["skipped"], "not_passing": bad}
    note = (f"{passed} passed, {n['failures']} failed, {n['errors']} errors, "
            f"{n['skipped']} skipped")
    return Reading(figures, n["failures"] == n["errors"] == 0 and passed >= 1, note)


# --------------------------------------------------------------------- sandbox, pool and HTTP
def sandbox_cmd(ctx: Ctx) -> list[str]:
    # capacity: closed loop, `concurrency` callers; then Poisson arrivals at 50% and 90% of it
    workers, seconds, calls, conc = (2, 1, 100, 16) if ctx.dry else (ctx.cpus, 4, 4000, 64)
    return [ctx.python, "bench/tool_latency.py", "--modes", "pool,http", "--workers", str(workers),
            "--open-loop", "0.5,0.9", "--open-workloads", "W1-trivial,W3-sympy",
            "--open-seconds", str(seconds), "--capacity-calls", str(calls),
            "--capacity-concurrency", str(conc), "--out", str(ctx.dir / "tool_latency_open.json")]


def sandbox_read(ctx: Ctx) -> Reading:
    data = _load(ctx.dir / "tool_latency_open.json")
    rows = data["open_rows"]

    def pick(mode: str, wid: str, frac: float) -> dict:
        return next(r for r in rows if r["mode"] == mode and r["workload"] == wid
                    and abs(r["fraction"] - frac) < 1e-9)

    f: dict[str, Any] = {"workers": data["workers"],
                         "isolation": {m: v.get("isolation") for m, v in data["modes"].items()}}
    for mode in ("pool", "http"):
        for wid, short in (("W1-trivial", "w1"), ("W3-sympy", "w3")):
            f[f"{mode}_{short}_calls_s"] = pick(mode, wid, 0.5)["capacity_calls_per_s"]
        f[f"{mode}_w1_p99_ms_at_50"] = pick(mode, "W1-trivial", 0.5)["p99_ms"]
        f[f"{mode}_w1_p99_ms_at_90"] = pick(mode, "W1-trivial", 0.9)["p99_ms"]
    f["http_vs_pool_w1"] = f["http_w1_calls_s"] / f["pool_w1_calls_s"]
    met = f["http_vs_pool_w1"] >= 0.9 and f["http_w1_p99_ms_at_50"] <= 10.0
    note = (f"W1 http {f['http_w1_calls_s']:,.0f}/s = {f['http_vs_pool_w1']:.0%} of pool "
            f"{f['pool_w1_calls_s']:,.0f}/s; p99 at 50% {f['http_w1_p99_ms_at_50']:.1f} ms")
    return Reading(f, met, note)


# ------------------------------------------------------------- local engine vs model.generate
def engine_cmd(streams: int, dry_streams: int) -> Callable[[Ctx], list[str]]:
    def cmd(ctx: Ctx) -> list[str]:
        shape = (["--device", "cpu", "--models", "tiny", "--streams", str(dry_streams),
                  "--prompt", "32", "--new", "16"] if ctx.dry else
                 ["--device", "cuda", "--models", "qwen3-0.6b", "--streams", str(streams),
                  "--prompt", "256", "--new", "256"])
        shape += ["--arms", "eager", "static", "--check-new", "8" if ctx.dry else "16",
                  "--split"]
        return [ctx.python, "bench/local_engine.py", *shape,
                "--out", str(ctx.dir / "local_engine.json")]
    return cmd


def engine_read(bar: float) -> Callable[[Ctx], Reading]:
    """The static (CUDA-graph) path is judged: its tokens/s over `generate`'s, with every
    stream's greedy tokens equal to the eager path's in the same run (fp32); the eager path's
    ratio is shown beside it."""
    def read(ctx: Ctx) -> Reading:
        row = _load(ctx.dir / "local_engine.json")["rows"][0]
        f = {k: row.get(k) for k in ("model", "streams", "prompt", "new", "eager_tps",
                                     "static_tps", "generate_tps", "eager_ratio",
                                     "static_ratio", "eager_steps", "static_steps",
                                     "static_captures", "static_split", "loadavg")}
        eq = row.get("equal") or {}
        f["equal"] = eq
        same = eq.get("static_eq_eager")
        f["ratio"] = f["static_ratio"]
        note = (f"static {f['static_tps']:,.0f} tok/s, eager {f['eager_tps']:,.0f}, generate "
                f"{f['generate_tps']:,.0f}: {f['static_ratio']:.2f}x (eager "
                f"{f['eager_ratio']:.2f}x); greedy static = eager {same}/{eq.get('streams')}, "
                f"= generate {eq.get('static_eq_generate')}, seeded "
                f"{eq.get('seeded_static_eq_eager')}")
        if f.get("static_split"):  # where a static step's time went (bench/local_engine.py)
            parts = f["static_split"]
            note += (f"; static step {sum(parts.values()):.1f} ms: device "
                     f"{parts['device_ms']:.1f}, host {parts['host_prep_ms'] + parts['thread_ms']:.1f}"
                     f" + loop {parts['loop_ms']:.1f}, prefill {parts['prefill_ms']:.1f}")
        met = f["static_ratio"] >= bar and same is not None and same == eq.get("streams")
        return Reading(f, met, note)
    return read


# -------------------------------------------------------------- Megatron step vs TorchTrainer
def megatron_cmd(size: str, dry_size: str = "tiny", seqs: int = 16, profile: bool = False
                 ) -> Callable[[Ctx], list[str]]:
    """`profile`: one more Megatron step under torch.profiler after the timed ones (its top
    ops go into the JSON and `profile/megatron_step_top_ops.txt`; the Chrome trace stays on
    the machine's disk, too big to bring back)."""
    def cmd(ctx: Ctx) -> list[str]:
        shape = (["--size", dry_size, "--seq-len", "64", "--seqs", "8", "--steps", "1",
                  "--micro-batch-tokens", "512"] if ctx.dry else
                 ["--size", size, "--seq-len", "4096", "--seqs", str(seqs), "--steps", "2",
                  "--micro-batch-tokens", "8192"])
        prof = ["--profile", str(ctx.dir / "profile")] if profile else []
        return [ctx.python, "bench/megatron_step.py", *shape, "--compare-torch", *prof,
                "--out", str(ctx.dir / "megatron_step.json")]
    return cmd


def megatron_read(min_mfu: float, min_speedup: float | None) -> Callable[[Ctx], Reading]:
    def read(ctx: Ctx) -> Reading:
        res = _load(ctx.dir / "megatron_step.json")
        mg, tt = res["megatron"], res["torch"]
        keys = ("step_s_median", "tokens_per_s_per_gpu", "mfu", "peak_mem_gib", "alloc_retries")
        f: dict[str, Any] = {"device": res["device"], "size": res["size"],
                             "seqs": res["seqs"], "seq_len": res["seq_len"],
                             "recompute": mg.get("recompute"), "attention": mg.get("attention")}
        f.update({f"megatron_{k}": mg.get(k) for k in keys})
        f.update({f"torch_{k}": tt.get(k) for k in keys})
        f["megatron_vs_torch"] = res["torch_speedup"]  # torch's step time / megatron's
        if res.get("profile_top_ops"):  # the table's header and its first ops
            f["profile_top_ops"] = res["profile_top_ops"][:14]
        met: bool | None = None
        if mg.get("mfu") is not None:
            met = mg["mfu"] >= min_mfu and (min_speedup is None
                                            or f["megatron_vs_torch"] >= min_speedup)
        note = (f"MFU {_pct(mg.get('mfu'))} (torch {_pct(tt.get('mfu'))}), "
                f"{mg['tokens_per_s_per_gpu']:,.0f} tok/s = {f['megatron_vs_torch']:.2f}x "
                f"torch's" + (f", {mg['peak_mem_gib']:.1f} GiB" if mg.get("peak_mem_gib")
                              else ""))
        return Reading(f, met, note)
    return read


# ------------------------------------------------------------------------ the tiny curriculum
# On the GPU: a shorter cold start (600 steps, as tiny.toml had before its 900) and RL stages
# of 3, 3 and 2 steps, evaluated after SFT and at the end only (greedy plus one sample each).
GPU_CUT = ["stages.0.steps=600", "stages.0.lr_decay_steps=200", "stages.1.steps=3",
           "stages.2.steps=3", "stages.3.steps=2", "stages.3.hard_filter_problems=128",
           "eval.every_steps=0", "eval.k=1", "checkpoint.every_steps=0"]
# The dry run: every stage runs, a step or a few each, on 64 problems and 32-token answers.
DRY_CUT = ["stages.0.steps=4", "stages.0.batch_size=4", "stages.0.lr_decay_steps=2",
           "stages.1.steps=1", "stages.2.steps=1", "stages.3.steps=1",
           "stages.3.hard_filter_problems=4", "rollout.prompts_per_step=2",
           "rollout.samples_per_prompt=2", "rollout.group_size=2",
           "stages.1.max_response_tokens=32", "stages.2.max_response_tokens=32",
           "stages.3.max_response_tokens=32", "eval.every_steps=0", "eval.k=1",
           "eval.max_problems=4", "eval.max_response_tokens=32",
           "data.generator_options.train_size=64", "data.generator_options.eval_size=8",
           "checkpoint.every_steps=0"]


def curriculum_cmd(trainer: str) -> Callable[[Ctx], list[str]]:
    def cmd(ctx: Ctx) -> list[str]:
        sets = ["logging.console=none", *(DRY_CUT if ctx.dry else GPU_CUT)]
        if trainer == "megatron":
            sets.append("trainer.kind=megatron")  # megatron takes the GPU when there is one
        elif not ctx.dry:
            sets.append("trainer.device=cuda")
        if not ctx.dry:
            sets.append("engine.device=cuda")
        return [ctx.python, "-m", "asyncrl", "train", TINY, "--run-dir", str(ctx.dir / "run"),
                *_sets(sets)]
    return cmd


def read_run(run_dir: Path) -> dict[str, Any]:
    """Accuracy after SFT and at the end, wall time and RL step time of a finished run."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    evals = [r for r in rows if r["kind"] == "eval"]
    steps = [r for r in rows if r["kind"] == "rl_step"]
    done = next(r for r in rows if r["kind"] == "done")
    final = next((r for r in evals if r.get("label") == "final"), evals[-1])
    return {"acc_after_sft": evals[0]["eval/accuracy"], "acc_final": final["eval/accuracy"],
            "eval_problems": final.get("eval/problems"), "rl_steps": len(steps),
            "step_s_mean": (sum(r["timing/step_s"] for r in steps) / len(steps)
                            if steps else None),
            "wall_s": done["wall_s"]}


def curriculum_read(trainer: str) -> Callable[[Ctx], Reading]:
    def read(ctx: Ctx) -> Reading:
        f = read_run(ctx.dir / "run")
        note = (f"held-out {f['acc_after_sft']:.1%} after SFT -> {f['acc_final']:.1%}, "
                f"{f['rl_steps']} RL steps, {f['wall_s']:.0f} s")
        if trainer == "torch":
            return Reading(f, None, note)
        try:
            ref = read_run(ctx.out / "curriculum_torch" / "run")
        except (OSError, StopIteration, IndexError, KeyError, ValueError):
            return Reading(f, None, note + "; no torch run to compare")
        f["torch_acc_final"] = ref["acc_final"]
        f["minus_torch_points"] = 100 * (f["acc_final"] - ref["acc_final"])
        return Reading(f, abs(f["minus_torch_points"]) <= 5.0,
                       note + f"; {f['minus_torch_points']:+.1f} points vs torch")
    return read


# ---------------------------------------------------------------- async: N = 0 against N = 2
# RL from the torch curriculum's final model (its cold start is paid once), one stage per arm
ASYNC_GPU = ["trainer.device=cuda", "engine.device=cuda", "stages.0.steps=4",
             "eval.every_steps=0", "eval.k=1", "eval.max_problems=32", "checkpoint.every_steps=0"]
ASYNC_DRY = ["stages.0.steps=2", "stages.0.max_response_tokens=32",
             "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
             "rollout.group_size=2", "eval.every_steps=0", "eval.k=1", "eval.max_problems=4",
             "eval.max_response_tokens=32", "data.generator_options.train_size=64",
             "data.generator_options.eval_size=8", "checkpoint.every_steps=0"]


def async_cmd(ctx: Ctx) -> list[str]:
    sft_dir = ctx.out / "curriculum_torch" / "run" / "final"
    return [ctx.python, "bench/async_staleness.py", "--arms", "n0", "n2", "--seeds", "0",
            "--rl-stages", "1", "--sft-dir", str(sft_dir), "--runs-dir", str(ctx.dir / "runs"),
            "--out", str(ctx.dir / "async_staleness.json"),
            *_sets(ASYNC_DRY if ctx.dry else ASYNC_GPU)]


def async_read(ctx: Ctx) -> Reading:
    s = _load(ctx.dir / "async_staleness.json")["summary"]
    f = {f"{arm}_{k}": s[arm][k] for arm in ("n0", "n2")
         for k in ("step_s_mean", "wall_per_step_s", "stale_token_frac_mean", "eval_final")}
    # the loop's own step time: the final evaluation, the same in both arms, is left out
    f["n2_speedup"] = f["n0_step_s_mean"] / f["n2_step_s_mean"]
    note = (f"RL step N=0 {f['n0_step_s_mean']:.2f} s, N=2 {f['n2_step_s_mean']:.2f} s: "
            f"{f['n2_speedup']:.2f}x")
    return Reading(f, f["n2_speedup"] >= 1.3, note)


CHECKS: tuple[Check, ...] = (
    Check("pytest_gpu", "pytest -m gpu", "green: none failed or errored, >= 1 passed",
          50, 30, pytest_cmd, pytest_read, ok_returncodes=(0, 1), cap_s=150),
    Check("sandbox", "sandbox on all cores: pool and HTTP capacity, open loop",
          "HTTP >= 90% of pool (W1, 64 in flight); W1 at 50% load p99 <= 10 ms (HTTP)",
          50, 25, sandbox_cmd, sandbox_read),
    # the engine checks time three arms (eager, static with CUDA graphs, generate), check their
    # equality in fp32 and time the static arm again with --split: 71 and 89 s on 2026-11-29
    # without the split pass, which adds one static run (~5 and ~15 s)
    Check("engine_64", "local engine (eager, static + CUDA graphs) vs model.generate, 0.6B, "
          "64 x 256 tokens", "static engine >= 5x generate, greedy equal to eager",
          80, 20, engine_cmd(64, 4), engine_read(5.0), cap_s=200),
    Check("engine_256", "local engine (eager, static + CUDA graphs) vs model.generate, 0.6B, "
          "256 x 256 tokens", "static engine >= 3x generate, greedy equal to eager",
          105, 20, engine_cmd(256, 8), engine_read(3.0), cap_s=200),
    Check("megatron_0.6b", "Megatron step vs TorchTrainer, 0.6B, 16 x 4096",
          "MFU >= 25%", 70, 25, megatron_cmd("0.6b"), megatron_read(0.25, None)),
    Check("megatron_1.7b", "Megatron step vs TorchTrainer, 1.7B, 16 x 4096, + 1 profiled step",
          # not yet measured: killed at its 96 s timeout on 2026-11-27, while the 0.6B took 67;
          # first in its call (issue 57), with one profiled step (~20 s more, a guess)
          "MFU >= 40% and >= 1.5x torch's tokens/s", 150, 30, megatron_cmd("1.7b", profile=True),
          megatron_read(0.40, 1.5), cap_s=240, lead=True),
    Check("megatron_moe", "Megatron step vs TorchTrainer, Qwen3-30B-A3B layers x2, 8 x 4096",
          # first MoE measurement (issue 56): the MFU bar of the dense 0.6B, to be revised
          "MFU >= 25%", 130, 30, megatron_cmd("30b-a3b-2l", "moe-tiny", seqs=8),
          megatron_read(0.25, None), cap_s=240),
    Check("curriculum_torch", "tiny curriculum (cut), torch trainer",
          "none of its own (the reference for Megatron's)", 125, 45, curriculum_cmd("torch"),
          curriculum_read("torch")),
    Check("curriculum_megatron", "tiny curriculum (cut), Megatron trainer",
          "final held-out accuracy within 5 points of torch's", 145, 45,
          curriculum_cmd("megatron"), curriculum_read("megatron")),
    Check("async", "async N=0 vs N=2, seconds per RL step (from the torch run's model)",
          "N=2 >= 1.3x N=0 per RL step", 70, 50, async_cmd, async_read,
          needs=("curriculum_torch",)),
)
