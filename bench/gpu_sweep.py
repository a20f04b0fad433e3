"""Every GPU check in one command, leads then cheapest first, in a time budget: one JSON, one table.

A GPU machine is lent only at times and for about 15 minutes in all (its start, every command
and the idle time count; one command runs 10 minutes at most), so the checks are prepared here
and run in one call: `pytest -m gpu`, the local engine against `model.generate` at 64 and 256
streams, the sandbox on all cores, the Megatron step at 0.6B and 1.7B beside the torch trainer,
the tiny curriculum with the torch then the Megatron trainer, async N=0 against N=2. The list
and each check's command, bar and reader are `bench/gpu_checks.py`; docs/gpu.md says how to run
this on a lent machine (`tools/gpu_carry.sh`) and where its figures go.

Each check runs as its own process group with its own timeout (the smaller of its cap and what
is left of the budget), its output in `<out-dir>/<check>/log.txt`, so a failure or a hang costs
that check alone. Before a check starts, its estimate is charged against what is left of the
budget: one that would not fit is skipped and its row says so, as is one whose `needs` did not
pass. Order: the lead checks first (`Check.lead`: `megatron_1.7b`, never measured yet, so
that no overrunning check starves it; issue 57), then the cheapest check whose needs have run. Each row records pass (ran to
the end and its figures were read), fail (exit status, timeout or missing figures, with the
last lines of its log) or skip, with the reason, its figures, its bar and whether the bar was
met. A missed bar does not fail the sweep (figures are reported, not asserted); a failed check
does (exit 1).

`--dry-run` runs the same sequence on the CPU with tiny shapes: the same entry points with the
same options and smaller values, so a command that would break on the GPU breaks here first
(CI runs it). Its figures check the sweep, not speed: bars are computed but shown in
parentheses and recorded as not judged.

    python bench/gpu_sweep.py [--dry-run] [--budget 500] [--only a,b] [--skip a,b] [--list]
                              [--out-dir DIR]

Writes `<out-dir>/sweep.json` after every check (out-dir: bench/results/gpu_sweep, or
bench/results/gpu_sweep_dry for --dry-run) and prints the table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checks import CHECKS, ROOT, Check, Ctx

RESULTS = ROOT / "bench" / "results"
BUDGET_S = 500.0  # a lent machine's 10-minute command less the install and collection around it
DRY_BUDGET_S = 1500.0  # a loaded 2-core machine; the dry run takes 2-4 minutes on a quiet one
DRY_CAP_S = 600.0


def plan(checks: tuple[Check, ...]) -> list[Check]:
    """The lead checks first (in declared order: bars never measured yet, issue 57), then the
    cheapest on the GPU first, each after the checks it needs (ties keep the declared order);
    the dry run keeps the same sequence. `--only` / `--skip` choose from this order."""
    left, out = list(checks), list[Check]()
    names = {c.name for c in checks}
    for c in checks:
        missing = set(c.needs) - names
        if missing:
            raise ValueError(f"{c.name} needs unknown check(s) {sorted(missing)}")
    while left:
        ready = [c for c in left if all(n in {o.name for o in out} for n in c.needs)]
        if not ready:
            raise ValueError(f"a cycle of needs among {[c.name for c in left]}")
        nxt = min(ready, key=lambda c: (not c.lead, 0.0 if c.lead else c.estimate_s))
        out.append(nxt)
        left.remove(nxt)
    return out


def estimate(c: Check, dry: bool) -> float:
    return c.dry_estimate_s if dry else c.estimate_s


def cap(c: Check, dry: bool) -> float:
    return DRY_CAP_S if dry else (c.cap_s or 2.5 * c.estimate_s)


def probe_device(python: str) -> dict[str, Any]:
    """torch's version and the GPU's name, asked in a child so this process holds no CUDA
    context while the checks run."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': "
            "torch.__version__, 'cuda': c, 'name': torch.cuda.get_device_name() if c else "
            "None}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"torch": None, "cuda": False, "name": None, "error": str(e)}


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the check's process group, SIGKILL what is left once the leader has exited (or
    after `grace_s`). Also ends children (sandbox servers, workers) that a check which exited by
    itself left behind, so none holds the GPU or the cores during the next check."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # nothing of the group is left
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_command(argv: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run one check's command in its own session; returns (exit status or None when it ran
    past `timeout_s`, wall seconds)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    t0 = time.monotonic()
    with log.open("w") as fh:
        fh.write(f"$ {shlex.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also when the sweep itself is stopped: its own session would outlive it
            kill_group(proc)
    return rc, time.monotonic() - t0


class Stopped(Exception):
    """SIGTERM or SIGINT reached the sweep (an outer `timeout`, a Ctrl-C)."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def tail(path: Path, n: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run_check(c: Check, ctx: Ctx, timeout_s: float) -> dict[str, Any]:
    """Run one check and read its figures; returns its row's status, reason and reading."""
    if ctx.dir.exists():
        shutil.rmtree(ctx.dir)
    ctx.dir.mkdir(parents=True)
    log = ctx.dir / "log.txt"
    rc, wall = run_command(c.command(ctx), log, timeout_s)
    row: dict[str, Any] = {"rc": rc, "wall_s": round(wall, 1), "timeout_s": round(timeout_s)}
    if rc is None:
        row.update(status="fail", reason=f"timed out after {timeout_s:.0f} s (killed)")
    elif rc not in c.ok_returncodes:
        row.update(status="fail", reason=f"exit status {rc}")
    else:
        try:
            reading = c.read(ctx)
        # any reader error means the check's output is missing or not what it should be:
        # a failed check, whatever the exception, never a crash of the sweep
        except Exception as e:
            row.update(status="fail", reason=f"no figures: {type(e).__name__}: {e}")
        else:
            row.update(status="pass", reason="", figures=reading.figures, met=reading.met,
                       note=reading.note)
    if row["status"] == "fail":
        row["log_tail"] = tail(log)
    return row


NOT_CHOSEN = "not chosen (--only/--skip)"


def skip_reason(c: Check, rows: dict[str, dict], left_s: float, dry: bool,
                earlier: dict[str, dict]) -> str:
    """Why `c` does not run now ("" when it does). A need left out by --only/--skip counts as
    met when it passed in the earlier sweep into the same folder (`earlier`, its rows): a
    rerun of one check on a still-warm machine."""

    def met(n: str) -> bool:
        if rows.get(n, {}).get("reason") == NOT_CHOSEN:
            return earlier.get(n, {}).get("status") == "pass"
        return rows.get(n, {}).get("status") == "pass"

    failed = [n for n in c.needs if not met(n)]
    if failed:
        def why(n: str) -> str:
            if rows.get(n, {}).get("reason") == NOT_CHOSEN:
                return f"left out, earlier {earlier.get(n, {}).get('status', 'not run')}"
            return rows.get(n, {}).get("status", "not run")

        return "needs " + ", ".join(f"{n} ({why(n)})" for n in failed)
    if estimate(c, dry) > left_s:
        return f"would not fit: needs ~{estimate(c, dry):.0f} s, {max(0.0, left_s):.0f} s left"
    return ""


def met_cell(row: dict[str, Any], dry: bool) -> str:
    met = row.get("met")
    if row["status"] != "pass" or met is None:
        return "-"
    word = "yes" if met else "NO"
    return f"({word})" if dry else word


def print_table(rows: list[dict[str, Any]], dry: bool) -> None:
    w = max(len(r["check"]) for r in rows)
    print(f"\n{'check':<{w}}  {'status':<6} {'wall s':>7}  {'met':<5}  figures / reason")
    for r in rows:
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
        text = r.get("note") or r.get("reason", "")
        if "earlier" in r:
            e = r["earlier"]
            text += f"; earlier: {e['status']}: {e.get('note') or e.get('reason', '')}"
        print(f"{r['check']:<{w}}  {r['status']:<6} {wall:>7}  {met_cell(r, dry):<5}  {text}")
    print("\nbars:")
    for r in rows:
        print(f"  {r['check']:<{w}}  {r['bar']}")


def summary_line(rows: list[dict[str, Any]], dry: bool, wall: float, budget: float) -> str:
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    judged = [r for r in rows if r["status"] == "pass" and r.get("met") is not None]
    met = sum(bool(r["met"]) for r in judged)
    bars = (f"bars not judged (dry run; {met} of {len(judged)} would be met)" if dry
            else f"bars met {met} of {len(judged)}")
    return (f"gpu sweep{' (dry run)' if dry else ''}: {len(rows)} checks, {n['pass']} pass, "
            f"{n['fail']} fail, {n['skip']} skip; {bars}; {wall:.0f} s of {budget:.0f}")


@dataclass(frozen=True)
class Meta:
    dry: bool
    budget: float
    device: dict[str, Any]
    out: Path
    cpus: int


def run_sweep(order: list[Check], ctxs: dict[str, Ctx], m: Meta, only: list[str],
              skip: list[str], earlier: dict[str, dict]) -> list[dict[str, Any]]:
    """Run (or skip) each check in `order`; writes sweep.json after each, prints the table."""
    start, started = time.monotonic(), time.time()
    rows: dict[str, dict[str, Any]] = {}
    try:  # a copy of the tree (a lent machine's) may have no .git, or no git
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    load_before = os.getloadavg()
    stopped = ""
    for i, c in enumerate(order, 1):
        ctx = ctxs[c.name]
        row: dict[str, Any] = {"check": c.name, "what": c.what, "bar": c.bar,
                               "command": shlex.join(c.command(ctx)),
                               "estimate_s": estimate(c, m.dry), "judged": not m.dry,
                               "log": str((ctx.dir / "log.txt").relative_to(m.out))}
        left = m.budget - (time.monotonic() - start)
        reason = (NOT_CHOSEN if (only and c.name not in only) or c.name in skip
                  else f"the sweep was stopped by {stopped}" if stopped
                  else skip_reason(c, rows, left, m.dry, earlier))
        if reason:
            row.update(status="skip", reason=reason)
            if reason == NOT_CHOSEN and c.name in earlier:  # the figures it has, kept
                row["earlier"] = earlier[c.name]
            print(f"[{i}/{len(order)}] {c.name}: skip: {reason}", flush=True)
        else:
            timeout_s = min(cap(c, m.dry), left)
            print(f"[{i}/{len(order)}] {c.name}: {c.what} (~{estimate(c, m.dry):.0f} s, "
                  f"timeout {timeout_s:.0f} s)\n  $ {row['command']}", flush=True)
            t0 = time.monotonic()
            try:
                row.update(run_check(c, ctx, timeout_s))
            except Stopped as e:  # its processes are gone (run_command's `finally`)
                stopped = str(e)
                row.update(status="fail", reason=f"the sweep was stopped by {e} during it",
                           wall_s=round(time.monotonic() - t0, 1))
            print(f"  {row['status']} in {row['wall_s']:.1f} s: "
                  f"{row.get('note') or row['reason']}", flush=True)
            for line in row.get("log_tail", []):
                print(f"  | {line}", flush=True)
        rows[c.name] = row
        wall = time.monotonic() - start
        (m.out / "sweep.json").write_text(json.dumps({
            "dry_run": m.dry, "device": m.device, "budget_s": m.budget,
            "wall_s": round(wall, 1), "cpus": m.cpus, "load_before": load_before,
            "load_after": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "git_commit": commit, "cmd": shlex.join([sys.executable, *sys.argv]),
            "summary": summary_line(list(rows.values()), m.dry, wall, m.budget),
            "checks": list(rows.values())}, indent=1) + "\n")
    wall = time.monotonic() - start
    print_table(list(rows.values()), m.dry)
    print(f"\n{summary_line(list(rows.values()), m.dry, wall, m.budget)}; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}; wrote {m.out / 'sweep.json'}")
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the same sequence on the CPU with tiny shapes (what CI runs)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole sweep (default {BUDGET_S:.0f}, "
                         f"{DRY_BUDGET_S:.0f} with --dry-run)")
    ap.add_argument("--only", default="", help="comma-separated checks (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated checks to leave out")
    ap.add_argument("--list", action="store_true", help="print the plan and commands; run none")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    dry = args.dry_run
    known = {c.name for c in CHECKS}
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    if set(only + skip) - known:
        ap.error(f"unknown check(s): {', '.join(sorted(set(only + skip) - known))}; "
                 f"known: {', '.join(c.name for c in CHECKS)}")
    budget = args.budget if args.budget is not None else (DRY_BUDGET_S if dry else BUDGET_S)
    out = (args.out_dir or RESULTS / ("gpu_sweep_dry" if dry else "gpu_sweep")).resolve()
    cpus = os.cpu_count() or 1
    order = plan(CHECKS)
    ctxs = {c.name: Ctx(dry=dry, dir=out / c.name, out=out, python=sys.executable, cpus=cpus)
            for c in order}
    if args.list:
        for c in order:
            print(f"{c.name} (~{estimate(c, dry):.0f} s, cap {cap(c, dry):.0f} s"
                  + (f", needs {', '.join(c.needs)}" if c.needs else "") + f"): {c.bar}\n"
                  f"  $ {shlex.join(c.command(ctxs[c.name]))}")
        return 0

    device = {"name": "cpu (dry run)"} if dry else probe_device(sys.executable)
    if not dry and not device.get("cuda"):
        print(f"gpu sweep: no CUDA GPU here ({device}); `--dry-run` runs the same checks on "
              "the CPU with tiny shapes", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    try:  # the last sweep into this folder: its rows stand for the checks left out now
        last = json.loads((out / "sweep.json").read_text())["checks"]
        earlier = {r["check"]: r.get("earlier", r) if r.get("reason") == NOT_CHOSEN else r
                   for r in last}
        earlier = {n: r for n, r in earlier.items() if r.get("reason") != NOT_CHOSEN}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        earlier = {}
    where = "the CPU, tiny shapes" if dry else f"{device['name']} (torch {device['torch']})"
    print(f"gpu sweep on {where}, budget {budget:.0f} s, "
          f"{cpus} CPUs, load {os.getloadavg()[0]:.1f}; logs under {out}", flush=True)
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        rows = run_sweep(order, ctxs, Meta(dry, budget, device, out, cpus), only, skip, earlier)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
