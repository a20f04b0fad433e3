"""The scheduler's own failures, with the real sbatch / srun / scontrol / scancel, on the
three-node cluster of test_slurm_train.py (trainer nodes n0 and n1, sandbox node n2):

- preemption mid-RL, three ways: `scontrol requeue` (what Slurm's PreemptMode=REQUEUE does:
  SIGTERM to every step and the batch script, requeue by Slurm), `scancel --signal=TERM` (the
  steps alone: the batch script requeues the job itself) and USR1 to the batch script (what
  `--signal=B:USR1@N` sends before the time limit). The run stops safely with its last
  completed step checkpointed, the job starts again by itself with --resume, and its metrics
  hold each step once and equal an unpreempted run's step for step;
- a trainer node lost mid-job (its slurmd and every process on it SIGKILLed): rank 0 ends the
  job naming the rank and host it lost; once the node is back, a requeue resumes from the last
  checkpoint and the steps after it equal the unpreempted run's;
- the sandbox job step lost mid-RL (`scancel JOB.STEP`): tool calls fail as
  `sandbox_failure` while it is gone, the batch script starts it again, calls succeed again,
  and the run finishes; nothing hangs.

Slow: `python -m pytest -m slow tests/slurm/test_slurm_faults.py`.
"""

from __future__ import annotations

import re
import time

import pytest
from cluster import assert_same_steps, rows, tool_statuses
from slurmrun import config, log_lines, per_step, submit, wait_for_rl_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RL_STEPS = 6
SANDBOX_RL_STEPS = 60  # long enough for the sandbox step to come back before the end
DONE = {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def unpreempted(slurm, prepared_model, tmp_path_factory):
    """The config and the per-step metrics of the same job never interrupted."""
    tmp = tmp_path_factory.mktemp("unpreempted")
    cfg = config(tmp / "run.toml", prepared_model, rl_steps=RL_STEPS)
    run_dir, out = tmp / "run", tmp / "job.out"
    job = submit(slurm, cfg, run_dir, out)
    assert slurm.wait_state(job, DONE, 600, [out]) == "COMPLETED", out.read_text()[-4000:]
    return cfg, per_step(run_dir)


def assert_equal_steps(got: list[dict], want: list[dict]) -> None:
    assert any(r.get("rollout/tool_calls_mean", 0) > 0 for r in want)  # runs with tool calls
    assert_same_steps(got, want)


def wait_restarted(slurm, job: str, timeout: float, out) -> None:
    """Block until the job's batch script has started again (its second start's first line;
    Slurm holds a requeued job for about two minutes: `Reason=BeginTime`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"[job {job} start 1 " in out.read_text(errors="replace"):
            return
        time.sleep(1)
    raise AssertionError(f"job {job} not restarted after {timeout}s: {slurm.job(job)}\n"
                         f"{out.read_text()[-4000:]}")


@pytest.mark.parametrize("how", ["scontrol_requeue", "scancel_signal_term", "usr1_time_limit"])
def test_preempted_job_stops_safely_requeues_and_resumes_step_for_step(slurm, unpreempted,
                                                                       tmp_path, how):
    cfg, want = unpreempted
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm, cfg, run_dir, out)
    wait_for_rl_step(run_dir, 2, 600, out)
    t0 = time.monotonic()
    if how == "scontrol_requeue":
        slurm.run(["scontrol", "requeue", job])
    elif how == "scancel_signal_term":
        slurm.run(["scancel", "--signal=TERM", job])
    else:
        slurm.run(["scancel", "--batch", "--signal=USR1", job])
    wait_restarted(slurm, job, 300, out)
    restarted_s = time.monotonic() - t0
    assert slurm.wait_state(job, DONE, 600, [out]) == "COMPLETED", out.read_text()[-4000:]
    text = out.read_text()

    # the first start stopped on the signal and saved its last completed step
    assert "asyncrl: SIGTERM: stopping after the current step" in text, text[-4000:]
    first, _, second = text.partition(f"[job {job} start 1 ")
    assert second, text[-4000:]
    if how == "scontrol_requeue":
        assert "SIGTERM from Slurm" in first
    elif how == "usr1_time_limit":
        assert "USR1: the time limit is near" in first and "requeueing" in first
    else:
        assert re.search(r"stopped on a signal \(exit \d+\) and saved its last completed step; "
                         "requeueing", first), first
    stop_saved = [r for r in log_lines(out, "checkpoint_saved") if r.get("stage") == "rl"]
    metrics = [r for r in rows(run_dir, "rl_step")]
    (resumed,) = rows(run_dir, "resumed")
    # the restart resumed from the step the stop saved, which was the last one trained
    assert "--resume" in second.splitlines()[3] or " --resume" in second
    assert any(r["step"] == resumed["step"] for r in stop_saved), (stop_saved, resumed)
    assert 2 <= resumed["step"] < RL_STEPS
    # each step once, and the same as never stopped
    assert [r["step"] for r in metrics] == list(range(1, RL_STEPS + 1))
    assert_equal_steps(per_step(run_dir), want)
    print(f"{how}: resumed after RL step {resumed['step']}; restarted {restarted_s:.0f}s "
          "after the signal")


def test_a_lost_trainer_node_ends_the_job_clearly_and_a_requeue_resumes(slurm, unpreempted,
                                                                        tmp_path):
    cfg, want = unpreempted
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm, cfg, run_dir, out, args=("--set", "checkpoint.every_steps=2"))
    wait_for_rl_step(run_dir, 3, 600, out)
    killed = slurm.kill_node(1)
    assert killed  # the trainer task's slurmstepd, torchrun and rank 1
    # rank 0 ends the job, naming what it lost
    deadline = time.monotonic() + 300
    while "lost rank 1 on 198.18.0.2 (n1)" not in out.read_text():
        assert time.monotonic() < deadline, out.read_text()[-4000:]
        time.sleep(1)
    state = ""
    while time.monotonic() < deadline:
        state = slurm.state(job)
        if state != "RUNNING":
            break
        time.sleep(1)
    assert state != "RUNNING", out.read_text()[-4000:]
    text = out.read_text()
    assert "restart every node with --resume" in text
    first_states = state

    slurm.start_slurmd(1)
    slurm._wait(lambda: slurm.node_state(1) in ("idle", "alloc", "mix"), 120, "n1 back",
                slurm.sinfo)
    if slurm.state(job) in DONE:   # failed for good: the user requeues it
        slurm.run(["scontrol", "requeue", job])
    assert slurm.wait_state(job, DONE, 600, [out]) == "COMPLETED", out.read_text()[-4000:]
    (resumed,) = rows(run_dir, "resumed")
    assert resumed["step"] in (2, 4)  # the last cadence checkpoint
    steps = [r["step"] for r in rows(run_dir, "rl_step")]
    redo = steps[-(RL_STEPS - resumed["step"]):]
    assert redo == list(range(resumed["step"] + 1, RL_STEPS + 1))
    # the resumed steps equal the unpreempted run's (SFT 10, 20 are the first two rows)
    got = per_step(run_dir)
    assert_equal_steps(got[-len(redo):], want[-len(redo):])
    print(f"node lost: job state {first_states} after the loss; resumed after RL step "
          f"{resumed['step']}")


def test_the_sandbox_step_lost_fails_calls_clearly_then_comes_back(slurm, prepared_model,
                                                                   tmp_path):
    cfg = config(tmp_path / "run.toml", prepared_model, rl_steps=SANDBOX_RL_STEPS,
                 temperature=1.0)
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    job = submit(slurm, cfg, run_dir, out, args=("--set", "logging.rollouts_every=1"))
    wait_for_rl_step(run_dir, 1, 600, out)
    (sandbox_step,) = [s for n, s in slurm.steps(job).items() if n == "sandbox"]
    slurm.run(["scancel", sandbox_step])
    assert slurm.wait_state(job, DONE, 600, [out]) == "COMPLETED", out.read_text()[-4000:]
    wall = time.monotonic() - t0
    text = out.read_text()
    assert "the sandbox step ended" in text and "starting it again" in text
    assert [r["step"] for r in rows(run_dir, "rl_step")] == list(range(1, SANDBOX_RL_STEPS + 1))
    statuses = {s: tool_statuses(run_dir, s) for s in range(1, SANDBOX_RL_STEPS + 1)}
    failed = [s for s, v in statuses.items() if "sandbox_failure" in v]
    assert failed, statuses                          # calls made while it was gone
    answered = [s for s, v in statuses.items() if s > max(failed) and {"ok", "error"} & set(v)]
    assert answered, statuses                        # and answered once it was back
    print(f"sandbox step lost: calls failed in RL steps {min(failed)}-{max(failed)}, answered "
          f"again from step {min(answered)}; job wall {wall:.0f}s")
