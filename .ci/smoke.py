"""CI smoke of the three ways users meet asyncrl, each run as a user runs it, from the checkout.

1. `asyncrl train curricula/tiny.toml` cut to a few steps with `--set`: every stage runs, the
   console names the run directory and report, and the run directory holds metrics.jsonl (one
   row per stage, RL step and eval), final/ (a Hugging Face model) and report/.
   `asyncrl train curricula/rstar2.toml --dry-run` on a machine without its model and data:
   the whole plan, each missing path a warning, exit 0.
2. `just bench quick`: every CPU bench runs to the end, prints its table, writes its JSON.
3. The README's embedding example, its python block run as it stands: every problem's group
   streams out.
4. `python bench/gpu_sweep.py --dry-run`: every GPU check's command runs on the CPU with tiny
   shapes, passes and prints its row, so the sweep a lent GPU machine runs is proven here.
5. The README's real-model commands (SmolLM2 from PyPI) in a fresh virtualenv that has only
   the README's first install, then `asyncrl eval curricula/smollm2.toml` on two problems.

Also: no tracked file points outside the checkout (the project's old shared folder beside it). `.ci/run` calls this after the
test suite in a copy of the checkout with nothing beside it; on its own it runs in place:

    python .ci/smoke.py [--only train,dry_run,bench,embedding,gpu_sweep,real_model,self_contained]

Exit status 1 when any check fails; the last line says how many passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class SmokeFailure(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SmokeFailure(what)


def run(argv: list[str], *, cwd: Path = ROOT, timeout: float, echo: bool = False) -> list[str]:
    """Run a command that must exit 0; returns its stdout lines. With `echo` its output passes
    through as it comes (the bench tables). PYTHONPATH puts this checkout's code first, so a
    run in place tests the checkout even where another one is installed editable."""
    print(f"$ {' '.join(argv)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if echo else subprocess.PIPE, text=True)
    if echo:
        lines = []
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
            if time.monotonic() > deadline:
                proc.kill()
                raise SmokeFailure(f"`{' '.join(argv)}` ran past {timeout:.0f}s")
        out, err, rc = "".join(lines), "", proc.wait()
    else:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SmokeFailure(f"`{' '.join(argv)}` ran past {timeout:.0f}s") from None
        rc = proc.returncode
    if rc != 0:
        if not echo:
            sys.stdout.write(out[-4000:] + err[-4000:])
        raise SmokeFailure(f"`{' '.join(argv)}` exited {rc}")
    return out.splitlines()


# a few steps of every stage of the real tiny curriculum, small batches
TINY_MICRO = ["stages.0.steps=4", "stages.0.batch_size=4", "stages.0.lr_decay_steps=2",
              "stages.1.steps=2", "stages.2.steps=1", "stages.3.steps=1",
              "stages.3.hard_filter_problems=4", "rollout.prompts_per_step=2",
              "rollout.samples_per_prompt=4", "rollout.group_size=2", "eval.every_steps=2",
              "eval.max_problems=4", "data.generator_options.train_size=64",
              "data.generator_options.eval_size=8", "checkpoint.every_steps=2"]


def micro_train(rd: Path) -> list[str]:
    """`asyncrl train curricula/tiny.toml`, cut down to seconds, into run directory `rd`."""
    sets = [a for kv in TINY_MICRO for a in ("--set", kv)]
    return run(["asyncrl", "train", "curricula/tiny.toml", "--run-dir", str(rd), *sets],
               timeout=900)


def smoke_train(tmp: Path) -> None:
    rd = tmp / "tiny"
    lines = micro_train(rd)
    check(f"run directory: {rd}" in lines, f"stdout names the run directory {rd}: {lines}")
    check(any(ln.startswith(f"report: {rd / 'report' / 'summary.md'}; trajectory viewer: ")
              for ln in lines), f"stdout names the report and viewer: {lines}")
    rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x]
    stages = [r["stage"] for r in rows if r["kind"] == "stage"]
    check(stages == ["sft", "rl-short", "rl-long", "rl-hard"], f"stages run: {stages}")
    steps = [r["step"] for r in rows if r["kind"] == "rl_step"]
    check(steps == [1, 2, 3, 4], f"RL steps logged: {steps}")
    check(any(r["kind"] == "sft_step" for r in rows), "an SFT step row")
    check(sum(r["kind"] == "eval" for r in rows) >= 2, "eval rows after SFT and at the end")
    check(rows[-1]["kind"] == "done", f"the last row is `done`: {rows[-1]['kind']}")
    for f in ("final/config.json", "final/model.safetensors", "final/tokenizer.json",
              "report/summary.md", "report/viewer.html", "config.json"):
        check((rd / f).is_file(), f"run directory has {f}")
    print(f"  {rd}: stages {stages}, RL steps {steps}, final/ and report/ written")


def smoke_dry_run(tmp: Path) -> None:
    lines = run(["asyncrl", "train", "curricula/rstar2.toml", "--dry-run"], timeout=300)
    print("\n".join(f"  {ln}" for ln in lines))
    check("engine: sglang; trainer: megatron; sandbox: remote" in lines, "components resolved")
    check(sum(ln.startswith("stage ") for ln in lines) == 4, "four stages printed")
    model_missing = not (ROOT / "checkpoints" / "Qwen3-14B-Base").exists()
    check(not model_missing or any(ln.startswith("warning: model.path: no such directory")
                                   for ln in lines), "the missing model is a warning")
    check(lines[-1].startswith("dry run: ok"), f"closing line: {lines[-1]!r}")
    tiny = run(["asyncrl", "train", "curricula/tiny.toml", "--dry-run"], timeout=300)
    check(tiny[-1] == "dry run: ok" and not any(ln.startswith("warning:") for ln in tiny),
          f"tiny.toml resolves with nothing missing: {tiny}")


def smoke_bench(tmp: Path) -> None:
    just = shutil.which("just")
    check(just is not None, "`just` is on PATH (the dev extra's rust-just)")
    lines = run([str(just), "bench", "quick"], timeout=1200, echo=True)
    scripts = [m.group(1) for ln in lines if (m := re.match(r"=== bench/(\w+)\.py", ln))]
    summary = [m for ln in lines if (m := re.match(r"bench: (\d+) of (\d+) ok \(quick", ln))]
    check(len(summary) == 1, "the runner's closing line `bench: N of N ok (quick, ...)`")
    done, total = int(summary[0].group(1)), int(summary[0].group(2))
    check(done == total == len(scripts) and total >= 7, f"{done} of {total} benches ok: {scripts}")


def smoke_gpu_sweep(tmp: Path) -> None:
    out = tmp / "gpu_sweep"
    lines = run([sys.executable, "bench/gpu_sweep.py", "--dry-run", "--out-dir", str(out)],
                timeout=1800, echo=True)
    res = json.loads((out / "sweep.json").read_text())
    rows = res["checks"]
    check(res["dry_run"] and len(rows) >= 9, f"a dry run of every check: {len(rows)} rows")
    bad = [f"{r['check']}: {r['status']} ({r['reason']})" for r in rows if r["status"] != "pass"]
    check(not bad, f"every check passes in the dry run: {bad}")
    closing = [ln for ln in lines if ln.startswith("gpu sweep (dry run): ")]
    check(len(closing) == 1 and f"{len(rows)} checks, {len(rows)} pass, 0 fail, 0 skip"
          in closing[0], f"the closing line: {closing}")
    check(all(any(ln.startswith(f"{r['check']} ") for ln in lines) for r in rows),
          "a table row per check")


def readme_real_model_block() -> list[str]:
    """The commands of the first bash block under the README's `## A real model ...` section
    (install the extras and the weights' package, import the model)."""
    text = (ROOT / "README.md").read_text()
    section = re.split(r"^## A real model\b.*$", text, maxsplit=1, flags=re.M)
    check(len(section) == 2, "README has a section `## A real model ...`")
    m = re.search(r"```bash\n(.*?)```", section[1].split("\n## ", 1)[0], re.S)
    check(m is not None, "that section has a ```bash block")
    assert m is not None
    return [ln.split("  #")[0].strip() for ln in m.group(1).splitlines() if ln.strip()]


def smoke_real_model(tmp: Path) -> None:
    """The README's SmolLM2 path as a user meets it: a fresh virtualenv with only the README's
    first install command (`pip install torch==2.13.0 && pip install -e .`, not the dev extra,
    which would hide a missing dependency), then the section's commands as written, then
    `asyncrl eval curricula/smollm2.toml` on two problems loads the imported model."""
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, "torch==2.13.0"], timeout=900)
    run([*pip, "-e", str(ROOT)], timeout=900)
    env_path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    for cmd in readme_real_model_block():  # as written, but run beside the checkout: the
        # import's models/ lands in `tmp`, never over a model a developer imported here
        cmd = cmd.replace("'.[", f"'{ROOT}[")
        run(["bash", "-c", f"export PATH='{env_path}'; {cmd}"], cwd=tmp, timeout=900)
    model = tmp / "models" / "smollm2-135m-instruct"
    check((model / "config.json").exists(), f"the import wrote {model}")
    out = run(["bash", "-c", f"export PATH='{env_path}'; asyncrl eval curricula/smollm2.toml "
               f"--max-problems 2 --k 1 --out {tmp / 'eval'} "
               f"--set 'model.path=\"{model}\"'"], timeout=900)
    check(any('"accuracy"' in ln for ln in out), "the eval printed its figures")


def readme_embedding_block() -> str:
    """The first python block under the README's `## Embedding ...` section."""
    text = (ROOT / "README.md").read_text()
    section = re.split(r"^## Embedding\b.*$", text, maxsplit=1, flags=re.M)
    check(len(section) == 2, "README has a section `## Embedding ...`")
    m = re.search(r"```python\n(.*?)```", section[1].split("\n## ", 1)[0], re.S)
    check(m is not None, "that section has a ```python block")
    assert m is not None
    return m.group(1)


def smoke_embedding(tmp: Path) -> None:
    block = readme_embedding_block()
    ids = re.findall(r"Problem\(id=\"([^\"]+)\"", block)
    check(bool(ids), "the example builds at least one Problem(id=...)")
    script = tmp / "readme_embedding.py"
    script.write_text(block)
    # run from a directory holding nothing but the trained run the example loads (`runs/tiny`,
    # made here by a micro run): it must need nothing else but the installed package
    if "runs/tiny" in block:
        micro_train(tmp / "runs" / "tiny")
    lines = run([sys.executable, str(script)], cwd=tmp, timeout=600)
    print("\n".join(f"  {ln}" for ln in lines))
    for pid in ids:
        check(any(ln.split(" ", 1)[0] == pid for ln in lines),
              f"a group of problem {pid!r} streamed out and was printed: {lines}")


BESIDE = "../" + "shared"  # built, so this file does not itself match what it looks for


def smoke_self_contained(tmp: Path) -> None:
    """Nothing in the checkout points at a folder beside it (the project's old shared one)."""
    out = []
    for p in sorted(ROOT.rglob("*")):
        rel = p.relative_to(ROOT)
        if not p.is_file() or p.suffix not in {".py", ".toml", ".md", ".json", ".sh", ""}:
            continue
        if rel.parts[0] in {".git", "runs"} or rel.parts[0].startswith(".venv") \
                or "results" in rel.parts or p == Path(__file__).resolve():
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):  # binaries and unreadable files hold no paths
            continue
        out += [f"{rel}:{i}" for i, ln in enumerate(text.splitlines(), 1) if BESIDE in ln]
    check(not out, f"files that point at {BESIDE}: {out}")


CHECKS: dict[str, Callable[[Path], None]] = {
    "self_contained": smoke_self_contained, "dry_run": smoke_dry_run, "train": smoke_train,
    "embedding": smoke_embedding, "bench": smoke_bench, "gpu_sweep": smoke_gpu_sweep,
    "real_model": smoke_real_model}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(CHECKS)}")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = set(names) - set(CHECKS)
    if unknown:
        ap.error(f"unknown check(s): {', '.join(sorted(unknown))}")
    failed = []
    for name in names:
        print(f"\n--- smoke: {name}", flush=True)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"asyncrl-smoke-{name}-") as tmp:
            try:
                CHECKS[name](Path(tmp))
            except SmokeFailure as e:
                failed.append(name)
                print(f"smoke: {name} FAILED ({time.monotonic() - start:.0f}s): {e}", flush=True)
                continue
        print(f"smoke: {name} ok ({time.monotonic() - start:.0f}s)", flush=True)
    print(f"\nsmoke: {len(names) - len(failed)} of {len(names)} ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
