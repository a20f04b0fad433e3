"""bench/gpu_sweep.py: the runner (timeouts, budget, needs, leftovers) with real processes, and
the plan's commands checked against the scripts and the config they drive, in both modes, so a
typo is found here and not on a lent GPU. The dry run itself (minutes) runs in CI's smoke."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import pytest

from asyncrl import config

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


sweep = _load("gpu_sweep")
checks = sweep.CHECKS
gc = sys.modules["gpu_checks"]  # what gpu_sweep imported: the same Check and Ctx classes


def _ctx(tmp: Path, name: str, dry: bool) -> object:
    return gc.Ctx(dry=dry, dir=tmp / name, out=tmp, python=sys.executable, cpus=16)


def _options(source: str) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry"])
def test_every_command_uses_options_and_values_its_entry_point_has(tmp_path, dry):
    sizes = _load("megatron_step").SIZES
    arms = _load("async_staleness").ARMS
    workloads = {w["id"] for w in json.loads((ROOT / "bench" / "tool-workloads.json")
                                             .read_text())["workloads"]}
    engine_src = (ROOT / "bench" / "local_engine.py").read_text()
    train_opts = _options((ROOT / "asyncrl" / "cli" / "train.py").read_text())
    for c in checks:
        argv = c.command(_ctx(tmp_path, c.name, dry))
        assert argv[0] == sys.executable
        if argv[1:3] == ["-m", "pytest"]:
            assert argv[3:5] == ["-m", "gpu"], argv
            continue
        if argv[1:4] == ["-m", "asyncrl", "train"]:
            assert (ROOT / argv[4]).is_file(), argv
            opts = train_opts
        else:
            script = ROOT / argv[1]
            assert script.is_file(), argv
            opts = _options(script.read_text())
        used = {a for a in argv[2:] if a.startswith("--")}
        assert used <= opts, f"{c.name}: {sorted(used - opts)} not options of {argv[1]}"
        val = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        if "--size" in val:
            assert val["--size"] in sizes
        if "--models" in val:
            assert f'"{val["--models"]}"' in engine_src
        if "--open-workloads" in val:
            assert set(val["--open-workloads"].split(",")) <= workloads
        if "--arms" in val:
            rest = argv[argv.index("--arms") + 1:]
            named = rest[:next(i for i, a in enumerate(rest) if a.startswith("--"))]
            from asyncrl.engine.local.engine import DECODES

            known = DECODES if argv[1] == "bench/local_engine.py" else arms
            assert named and set(named) <= set(known), (c.name, named)


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry"])
def test_every_config_override_is_a_valid_key_and_value(tmp_path, dry):
    """The curriculum runs' and the async arms' `--set`s load as a config (a bad key or value
    fails naming it), as `asyncrl train` and bench/async_staleness.py apply them."""
    stale = _load("async_staleness")
    for c in checks:
        argv = c.command(_ctx(tmp_path, c.name, dry))
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        if "train" in argv:
            cfg = config.load(ROOT / "curricula" / "tiny.toml", sets)
            want = "megatron" if c.name.endswith("megatron") else "torch"
            assert cfg.trainer.kind == want
            assert dry or cfg.engine.device == "cuda"
        elif "bench/async_staleness.py" in argv:
            for arm in ("n0", "n2"):
                cfg = config.load(ROOT / "curricula" / "tiny.toml",
                                  [f"stages={stale._stages('rl', 1)}", *stale.ARMS[arm], *sets])
                assert len(cfg.stages) == 1
                assert dry or (cfg.trainer.device == "cuda" and cfg.engine.device == "cuda")


def test_plan_is_leads_then_cheapest_first_and_after_what_a_check_needs():
    def mk(name: str, est: float, needs: tuple[str, ...] = (), lead: bool = False) -> object:
        return gc.Check(name, name, "bar", est, 1, lambda ctx: [], lambda ctx: None,
                        needs=needs, lead=lead)

    order = sweep.plan((mk("a", 30), mk("b", 10, needs=("c",)), mk("c", 20)))
    assert [c.name for c in order] == ["c", "b", "a"]
    order = sweep.plan((mk("a", 30), mk("z", 99, lead=True), mk("c", 20), mk("y", 50, lead=True)))
    assert [c.name for c in order] == ["z", "y", "c", "a"]
    with pytest.raises(ValueError, match="unknown"):
        sweep.plan((mk("a", 1, needs=("zz",)),))
    real = [c.name for c in sweep.plan(checks)]
    assert real.index("async") > real.index("curriculum_torch")
    # the 1.7B Megatron check, never measured, first (issue 57); then the cheapest
    assert real[:2] == ["megatron_1.7b", "pytest_gpu"] and set(real) == {c.name for c in checks}


def _py(code: str):
    return lambda ctx: [ctx.python, "-c", code]


def _write_json(ctx) -> list[str]:
    return [ctx.python, "-c", f"open({str(ctx.dir / 'r.json')!r}, 'w').write('{{\"x\": 3}}')"]


def _read_json(ctx):
    x = json.loads((ctx.dir / "r.json").read_text())["x"]
    return gc.Reading({"x": x}, x >= 3, f"x = {x}")


def _gone(pid: int) -> bool:
    """The process ended (a zombie awaiting its parent counts: it runs nothing)."""
    for _ in range(50):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def test_a_hang_is_killed_at_its_timeout_with_what_it_left_running(tmp_path):
    # the check starts a grandchild and then hangs: both must be gone when run_check returns
    code = ("import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
            f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid)); time.sleep(300)")
    c = gc.Check("hang", "hang", "bar", 1, 1, _py(code), _read_json)
    t0 = time.monotonic()
    row = sweep.run_check(c, _ctx(tmp_path, "hang", True), timeout_s=3)
    assert time.monotonic() - t0 < 30
    assert row["status"] == "fail" and row["reason"].startswith("timed out after 3 s")
    assert _gone(int((tmp_path / "pid").read_text())), "the check's grandchild still runs"


def test_sweep_goes_on_past_failures_and_skips_what_does_not_fit(tmp_path, monkeypatch, capsys):
    plan = (
        gc.Check("crash", "exits 3", "bar", 1, 1, _py("raise SystemExit(3)"), _read_json),
        gc.Check("ok", "writes its figures", "x >= 3", 2, 2, _write_json, _read_json),
        gc.Check("no_figures", "exits 0, writes nothing", "bar", 3, 3, _py("pass"), _read_json),
        gc.Check("after_crash", "needs crash", "bar", 4, 4, _write_json, _read_json,
                 needs=("crash",)),
        gc.Check("huge", "would not fit", "bar", 5, 10_000, _write_json, _read_json),
        gc.Check("after_ok", "needs ok", "bar", 6, 1, _write_json, _read_json, needs=("ok",)),
    )
    monkeypatch.setattr(sweep, "CHECKS", plan)
    rc = sweep.main(["--dry-run", "--out-dir", str(tmp_path), "--budget", "600"])
    assert rc == 1  # a check failed
    res = json.loads((tmp_path / "sweep.json").read_text())
    rows = {r["check"]: r for r in res["checks"]}
    assert list(rows) == ["crash", "ok", "no_figures", "after_crash", "huge", "after_ok"]
    assert rows["crash"]["status"] == "fail" and rows["crash"]["reason"] == "exit status 3"
    assert rows["ok"]["status"] == "pass" and rows["ok"]["figures"] == {"x": 3}
    assert rows["ok"]["met"] is True and rows["ok"]["judged"] is False
    assert rows["no_figures"]["status"] == "fail"
    assert rows["no_figures"]["reason"].startswith("no figures: FileNotFoundError")
    assert rows["after_crash"] == {**rows["after_crash"], "status": "skip",
                                   "reason": "needs crash (fail)"}
    assert rows["huge"]["status"] == "skip"
    assert rows["huge"]["reason"].startswith("would not fit: needs ~10000 s")
    assert rows["after_ok"]["status"] == "pass"
    out = capsys.readouterr().out
    assert re.search(r"^ok\s+pass\s+[\d.]+\s+\(yes\)\s+x = 3$", out, re.M), out
    assert "gpu sweep (dry run): 6 checks, 2 pass, 2 fail, 2 skip" in out

    # a rerun of two checks into the same folder: a need left out counts as the last sweep
    # left it (ok passed there, crash failed)
    assert sweep.main(["--dry-run", "--out-dir", str(tmp_path), "--only",
                       "after_ok,after_crash"]) == 0
    rows = {r["check"]: r for r in json.loads((tmp_path / "sweep.json").read_text())["checks"]}
    assert rows["after_ok"]["status"] == "pass"
    assert rows["after_crash"]["reason"] == "needs crash (left out, earlier fail)"
    assert rows["ok"]["reason"] == "not chosen (--only/--skip)"
    assert rows["ok"]["earlier"]["figures"] == {"x": 3}  # kept across reruns
    assert sweep.main(["--dry-run", "--out-dir", str(tmp_path), "--only", "after_ok"]) == 0
    rows = {r["check"]: r for r in json.loads((tmp_path / "sweep.json").read_text())["checks"]}
    assert rows["ok"]["earlier"]["status"] == "pass" and rows["after_ok"]["status"] == "pass"


def test_without_a_gpu_the_full_sweep_refuses_and_points_at_the_dry_run(tmp_path, capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert sweep.main(["--out-dir", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()


def test_megatron_bars_read_mfu_and_the_speedup(tmp_path):
    res = {"device": "NVIDIA H100 80GB HBM3", "size": "1.7b", "seqs": 16, "seq_len": 4096,
           "megatron": {"mfu": 0.41, "tokens_per_s_per_gpu": 30000.0, "peak_mem_gib": 60.0,
                        "step_s_median": 2.0, "recompute": "none", "attention": "sdpa"},
           "torch": {"mfu": 0.25, "tokens_per_s_per_gpu": 19000.0, "step_s_median": 3.2},
           "torch_speedup": 1.6}
    ctx = _ctx(tmp_path, "m", False)
    ctx.dir.mkdir()
    (ctx.dir / "megatron_step.json").write_text(json.dumps(res))
    assert gc.megatron_read(0.40, 1.5)(ctx).met is True
    res["torch_speedup"] = 1.4
    (ctx.dir / "megatron_step.json").write_text(json.dumps(res))
    r = gc.megatron_read(0.40, 1.5)(ctx)
    assert r.met is False and "MFU 41.0%" in r.note and "1.40x" in r.note
    assert gc.megatron_read(0.25, None)(ctx).met is True


def test_a_stopped_sweep_ends_the_running_check_and_records_it(tmp_path):
    """SIGTERM (an outer `timeout`) while a check runs: the check's own session, which would
    outlive the sweep, is ended; its row and the rest say so; sweep.json is written."""
    import signal
    import subprocess

    pid_file = tmp_path / "pid"
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_sweep", {str(ROOT / 'bench' / 'gpu_sweep.py')!r})
sweep = importlib.util.module_from_spec(spec); sys.modules["gpu_sweep"] = sweep
spec.loader.exec_module(sweep)
gc = sys.modules["gpu_checks"]
code = ("import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
        "open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
hang = gc.Check("hang", "hangs", "bar", 1, 1, lambda ctx: [ctx.python, "-c", code],
                lambda ctx: None)
after = gc.Check("after", "never runs", "bar", 2, 2, lambda ctx: [ctx.python, "-c", "pass"],
                 lambda ctx: None)
sweep.CHECKS = (hang, after)
sys.exit(sweep.main(["--dry-run", "--out-dir", {str(tmp_path / 'out')!r}]))
""")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    else:
        proc.kill()
        raise AssertionError(f"the check never started: {proc.communicate()[0]}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert _gone(int(pid_file.read_text())), "the check's grandchild outlived the sweep"
    rows = {r["check"]: r for r in json.loads((tmp_path / "out" / "sweep.json").read_text())
            ["checks"]}
    assert rows["hang"]["status"] == "fail"
    assert rows["hang"]["reason"] == "the sweep was stopped by SIGTERM during it"
    assert rows["after"] == {**rows["after"], "status": "skip",
                             "reason": "the sweep was stopped by SIGTERM"}


def test_the_moe_check_measures_a_qwen3_moe_and_its_dry_run_passes(tmp_path):
    """Issue 56: the sweep measures a Qwen3-30B-A3B-shaped layer stack with both trainers; its
    CPU twin (the tiny Qwen3-MoE) runs through the same entry point here."""
    sizes = _load("megatron_step").SIZES
    moe = next(c for c in checks if c.name == "megatron_moe")
    gpu = moe.command(_ctx(tmp_path, moe.name, False))
    size = sizes[gpu[gpu.index("--size") + 1]]
    assert size["model_type"] == "qwen3_moe" and size["num_experts"] == 128
    assert sweep.main(["--dry-run", "--out-dir", str(tmp_path / "out"), "--only",
                       "megatron_moe"]) == 0
    rows = json.loads((tmp_path / "out" / "sweep.json").read_text())["checks"]
    row = next(r for r in rows if r["check"] == "megatron_moe")
    assert row["status"] == "pass" and row["figures"]["size"] == "moe-tiny"
    assert row["figures"]["megatron_tokens_per_s_per_gpu"] > 0
