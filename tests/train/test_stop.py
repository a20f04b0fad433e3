"""Stopping `asyncrl train` with SIGINT / SIGTERM mid-SFT and mid-RL: the run exits within its
grace period with a checkpoint of the last completed step, prints the exact `--resume`
command, and that command continues from the next step with the same losses and metrics as a
run that was never stopped (seeded rollouts: `rollout.seed_requests`)."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from micro_config import MICRO_DATA, MICRO_MODEL, RUN_ENV, metric_rows, run_ok

from asyncrl import config
from asyncrl.checkpoint import latest_checkpoint, load_checkpoint
from asyncrl.errors import RunStopped
from asyncrl.stopping import StopRequest

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 30

CONFIG = """
[run]
name = "stop"
seed = 5
""" + MICRO_MODEL + MICRO_DATA + f"""[rollout]
prompts_per_step = 2
samples_per_prompt = 4
group_size = 2
max_turns = 2
max_response_tokens = 24
tool_format = "markdown"
seed_requests = true
[roc]
min_pos = 1
min_neg = 1
reject_equal_reward = false
[algorithm]
lr = 1e-3
[engine]
kv_token_budget = 8192
[sandbox]
workers = 1
time_limit_s = 2.0
[[stages]]
name = "sft"
kind = "sft"
steps = 120
batch_size = 2
[[stages]]
name = "rl"
steps = 8
[eval]
every_steps = 2
max_problems = 2
[checkpoint]
every_steps = 3
sft_every_steps = 4
keep_last = 2
signal_grace_s = {GRACE_S}
[logging]
console = "json"
"""

# what differs between two identical runs: wall-clock times and what is measured from them
_TIMING = ("timing/", "time", "wall", "seconds", "_s_", "rollout/generation_s", "rollout/queue_s",
           "rollout/tool_wait_s", "rollout/total_s", "per_s", "async/")


def _cmd(cfg: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir), *extra]


def _by(rows: list[dict], key: str) -> dict[int, dict]:
    out = {}
    for r in rows:  # a step logged twice (redone after a stop) counts once: the last
        out[r[key]] = r
    return out


def _same_row(got: dict, want: dict) -> None:
    keys = [k for k in want if k not in ("t", "ts", "time") and not any(m in k for m in _TIMING)]
    assert keys
    for k in keys:
        w, g = want[k], got.get(k)
        if isinstance(w, float):
            # `train/mismatch_*` (~3e-7) is the local engine's last-bit batching noise itself.
            tol = 1e-6 if k.startswith("train/mismatch") else 1e-9
            assert g == pytest.approx(w, rel=1e-6, abs=tol), (want.get("step"), k)
        else:
            assert g == w, (want.get("step"), k)


def _same_evals(part: Path, ref: Path) -> None:
    """Every evaluation of the reference, with the same results (seeded: an eval that a stop
    aborted is run by the resumed run before it goes on)."""
    want = {(r["step"], r["label"]): r for r in metric_rows(ref, "eval")}
    got = {(r["step"], r["label"]): r for r in metric_rows(part, "eval")}
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        _same_row(got[key], w)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The config and a run of it that was never stopped (the reference)."""
    tmp = tmp_path_factory.mktemp("stop")
    cfg = tmp / "stop.toml"
    cfg.write_text(CONFIG)
    ref = tmp / "ref"
    run_ok(_cmd(cfg, ref))
    return cfg, ref


def _stop_when(cfg: Path, run_dir: Path, sig: int, ready) -> tuple[str, int, float]:
    """Start a run, send `sig` once `ready(run_dir)`; (output, exit code, seconds to exit)."""
    proc = subprocess.Popen(_cmd(cfg, run_dir), cwd=ROOT, env=RUN_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not ready(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stdout.read()[-3000:] if proc.stdout else "")
        time.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=GRACE_S + 60)
    return out, proc.returncode, time.monotonic() - t0


def _resume_command(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if "Resume with: " in x)
    cmd = shlex.split(line.split("Resume with: ", 1)[1])
    assert cmd[:2] == ["asyncrl", "train"] and "--resume" in cmd
    return [sys.executable, "-m", "asyncrl.cli.main", *cmd[1:]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigint_mid_rl_saves_the_last_step_and_resume_matches_an_unstopped_run(
        setup: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, ref = setup
    part = tmp_path / "part"
    out, rc, exit_s = _stop_when(cfg, part, signal.SIGINT,
                                 lambda rd: len(metric_rows(rd, "rl_step")) >= 4)
    assert rc == 130, out[-3000:]
    assert exit_s < GRACE_S
    done = max(r["step"] for r in metric_rows(part, "rl_step"))  # the last completed step
    assert done >= 4
    ckpt = latest_checkpoint(part)
    assert ckpt is not None and ckpt.name == f"step_{done:08d}"  # not the cadence's step 3
    assert f"Newest checkpoint: {ckpt}" in out
    saved = load_checkpoint(ckpt, restore_rng=False)
    assert (saved["stage_index"], saved["stage_step"], saved["global_step"]) == (1, done, done)
    assert any(r["kind"] == "stopped" for r in metric_rows(part, "stopped"))

    out2 = run_ok(_resume_command(out))
    resumed = [json.loads(x) for x in out2.splitlines() if '"event": "resumed"' in x]
    assert resumed and resumed[0]["step"] == done
    new_steps = [json.loads(x)["step"] for x in out2.splitlines() if '"event": "rl_step"' in x]
    assert new_steps[0] == done + 1  # continues from the step after the checkpoint
    want, got = _by(metric_rows(ref, "rl_step"), "step"), _by(metric_rows(part, "rl_step"), "step")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in range(done + 1, 9):  # the same rollouts, losses, entropy, optimizer steps
        _same_row(got[step], want[step])
    _same_evals(part, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_mid_sft_saves_the_last_step_and_resume_matches_an_unstopped_run(
        setup: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, ref = setup
    part = tmp_path / "part"
    # SFT step 10 is logged (the first checkpoint, step 4's, is on disk): the stage is under
    # way past its cadence's step. (Sent once step 4's checkpoint existed, a SIGTERM once came
    # 5 ms after it, before step 5 ended, and the stop rightly saved step 4 again.)
    out, rc, exit_s = _stop_when(cfg, part, signal.SIGTERM,
                                 lambda rd: bool(metric_rows(rd, "sft_step")))
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert exit_s < GRACE_S
    ckpt = latest_checkpoint(part)
    assert ckpt is not None
    saved = load_checkpoint(ckpt, restore_rng=False)
    k = saved["stage_step"]
    assert saved["stage_index"] == 0 and 4 < k < 120, k  # a step past the cadence's, not the end
    assert not metric_rows(part, "rl_step")
    assert f"stage sft step {k}/120" in out and "Resume with: " in out

    run_ok(_resume_command(out))
    want, got = _by(metric_rows(ref, "sft_step"), "sft_step"), _by(metric_rows(part, "sft_step"), "sft_step")
    assert sorted(got) == sorted(want)
    later = [s for s in want if s > k]
    assert later
    for s in later:  # the SFT losses after the stop, then the whole RL stage
        _same_row(got[s], want[s])
    want_rl, got_rl = _by(metric_rows(ref, "rl_step"), "step"), _by(metric_rows(part, "rl_step"), "step")
    assert sorted(got_rl) == list(range(1, 9))
    for step in want_rl:
        _same_row(got_rl[step], want_rl[step])
    _same_evals(part, ref)


@pytest.mark.timeout(300)
async def test_a_stop_request_saves_the_last_completed_step_and_resume_goes_on(
        tmp_path: Path) -> None:
    # In process (the default suite's check; the signals themselves: test_stopping.py and the
    # slow tests above): a stop while step 2's rollouts are under way keeps step 1.
    from asyncrl.train import train_async

    path = tmp_path / "stop.toml"
    path.write_text(CONFIG)
    cfg = config.load(path, ["stages.0.steps=4", "stages.1.steps=3", "eval.every_steps=0",
                             "checkpoint.every_steps=0"])
    rd = tmp_path / "run"
    stop = StopRequest()

    async def stop_after_step_one() -> None:
        for _ in range(30_000):  # polls the metrics file (nothing to wait on), 5 min at most
            if await asyncio.to_thread(lambda: bool(metric_rows(rd, "rl_step"))):
                break
            await asyncio.sleep(0.01)
        stop.request()

    trigger = asyncio.create_task(stop_after_step_one())
    with pytest.raises(RunStopped) as info:
        await train_async(cfg, run_dir=str(rd), stop=stop, resume_command="RESUME")
    await trigger
    assert info.value.signal_name == "SIGTERM" and info.value.where.startswith("stage rl step 1/3")
    assert info.value.checkpoint == rd / "checkpoints" / "step_00000001"  # no cadence: the stop's
    assert not (rd / "final").exists()  # a stopped run is not a finished one
    saved = load_checkpoint(info.value.checkpoint, restore_rng=False)
    assert (saved["stage_index"], saved["stage_step"]) == (1, 1)
    assert len(saved["pending_problem_ids"]) == 2  # step 2's problems, regenerated on resume
    await train_async(cfg, run_dir=str(rd), resume=True)
    steps = [r["step"] for r in metric_rows(rd, "rl_step")]
    assert steps == [1, 2, 3]  # step 2 was never logged before the stop
    assert (rd / "final" / "config.json").exists()


@pytest.mark.timeout(600)
async def test_a_stop_gives_up_the_step_under_way_and_resume_matches_an_unstopped_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A step longer than the grace period (a real model's SFT step on a CPU) must not run into
    # the hard exit: the stop gives it up between two micro-batches, weights untouched, and the
    # last completed step is saved. Here the stop comes inside SFT step 3 and, in the resumed
    # run, inside RL step 2's update (grace 0: already past half of it); each is given up, and
    # the twice-resumed run matches one that was never stopped, step for step.
    from asyncrl.algo import step as step_mod
    from asyncrl.errors import StepAbandoned
    from asyncrl.train import train_async

    path = tmp_path / "stop.toml"
    path.write_text(CONFIG)
    # 128-token micro-batches: every step has several, so a stop can come between two
    sets = ["stages.0.steps=4", "stages.1.steps=3", "eval.every_steps=0",
            "checkpoint.every_steps=0", "checkpoint.sft_every_steps=0",
            "trainer.micro_batch_tokens=128"]
    cfg = config.load(path, sets)
    ref = tmp_path / "ref"
    await train_async(cfg, run_dir=str(ref))

    calls = {"sft": 0, "rl": 0, "mb": 0}
    stop_in: dict[str, int] = {}
    stop = StopRequest()
    real_sft, real_rl, real_loss = step_mod.sft_step, step_mod.rl_step, step_mod.sft_loss

    def sft_step(*a, **k):
        calls["sft"] += 1
        calls["mb"] = 0
        return real_sft(*a, **k)

    def rl_step(*a, **k):
        calls["rl"] += 1
        calls["mb"] = 0
        return real_rl(*a, **k)

    def sft_loss(*a, **k):  # the first micro-batch of the chosen SFT step asks for the stop
        calls["mb"] += 1
        if calls["sft"] == stop_in.get("sft") and calls["mb"] == 1:
            stop.request()
        return real_loss(*a, **k)

    real_train_mb = step_mod._train_micro_batch

    def train_mb(*a, **k):
        real_train_mb(*a, **k)
        calls["mb"] += 1
        if calls["rl"] == stop_in.get("rl") and calls["mb"] == 1:
            stop.request()

    monkeypatch.setattr(step_mod, "sft_step", sft_step)
    monkeypatch.setattr(step_mod, "rl_step", rl_step)
    monkeypatch.setattr(step_mod, "sft_loss", sft_loss)
    monkeypatch.setattr(step_mod, "_train_micro_batch", train_mb)

    rd = tmp_path / "run"
    stop_in["sft"] = 3
    with pytest.raises(StepAbandoned) as info:
        await train_async(cfg, run_dir=str(rd), stop=stop)
    assert info.value.where.startswith("stage sft step 2/4")
    saved = load_checkpoint(info.value.checkpoint, restore_rng=False)
    assert (saved["stage_index"], saved["stage_step"]) == (0, 2)

    # then inside the evaluation after the SFT stage, once one group of it is on disk: the
    # resumed run samples only the rest (`asyncrl.observe.journal`)
    from asyncrl.observe import journal as journal_mod

    real_fsync, resumed = journal_mod.os.fsync, []
    stop = StopRequest()

    def fsync(fd: int) -> None:
        real_fsync(fd)
        stop.request()

    real_collect = journal_mod.GroupJournal.collect

    async def collect(self, *a, **k):
        try:
            return await real_collect(self, *a, **k)
        finally:
            resumed.append(self.resumed)

    monkeypatch.setattr(journal_mod.os, "fsync", fsync)
    monkeypatch.setattr(journal_mod.GroupJournal, "collect", collect)
    with pytest.raises(RunStopped) as info:
        await train_async(cfg, run_dir=str(rd), resume=True, stop=stop)
    assert "sft step 4/4" in info.value.where and resumed == [0]
    partial = rd / "eval" / "000000-after_sft.jsonl.partial"
    assert len(partial.read_bytes().splitlines()) >= 2  # its header and the finished group(s)
    monkeypatch.setattr(journal_mod.os, "fsync", real_fsync)

    calls.update(sft=0, rl=0)
    stop_in.clear()
    stop_in["rl"] = 2
    stop = StopRequest()
    # an RL update is given up once half the grace is gone: at once here (the hard exit's
    # timer starts only on a real signal)
    quick = config.load(path, [*sets, "checkpoint.signal_grace_s=0.001"])
    with pytest.raises(StepAbandoned) as info:
        await train_async(quick, run_dir=str(rd), resume=True, stop=stop)
    assert info.value.where.startswith("stage rl step 1/3")
    assert info.value.checkpoint == rd / "checkpoints" / "step_00000001"
    saved = load_checkpoint(info.value.checkpoint, restore_rng=False)
    assert (saved["stage_index"], saved["stage_step"], saved["global_step"]) == (1, 1, 1)
    assert len(saved["pending_problem_ids"]) == 2  # the given-up step's problems, sampled again
    assert resumed[1] >= 1 and not partial.exists()  # the evaluation went on from its journal

    stop_in.clear()
    await train_async(cfg, run_dir=str(rd), resume=True)
    for kind, key in (("sft_step", "sft_step"), ("rl_step", "step")):
        want, got = _by(metric_rows(ref, kind), key), _by(metric_rows(rd, kind), key)
        assert sorted(got) == sorted(want) and want
        for k in want:
            _same_row(got[k], want[k])
    _same_evals(rd, ref)
