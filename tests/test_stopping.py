"""`asyncrl.stopping`: a stop request aborts what is awaited, a signal becomes a request, the
grace period and a second Ctrl-C exit at once, and never with a half-written checkpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.checkpoint import latest_checkpoint, list_checkpoints
from asyncrl.errors import RunStopped
from asyncrl.stopping import StopRequest, signal_handlers

ROOT = Path(__file__).resolve().parents[1]


async def test_a_stop_aborts_what_is_awaited_and_its_cleanup_runs() -> None:
    stop = StopRequest()
    stop.bind(asyncio.get_running_loop())
    cleaned = asyncio.Event()

    async def rollouts() -> str:
        try:
            await asyncio.sleep(30)
            return "done"
        finally:
            await asyncio.sleep(0.01)  # cleanup that awaits still runs to its end
            cleaned.set()

    asyncio.get_running_loop().call_later(0.05, stop.request, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(RunStopped, match="SIGTERM"):
        await stop.race(rollouts())
    assert time.monotonic() - t0 < 5 and cleaned.is_set()
    with pytest.raises(RunStopped):  # once requested, every later race stops at once
        await stop.race(asyncio.sleep(0, result="x"))


async def test_work_that_finishes_first_is_returned() -> None:
    stop = StopRequest()
    stop.bind(asyncio.get_running_loop())
    assert await stop.race(asyncio.sleep(0.01, result=7)) == 7
    stop.check()  # no request: no stop


async def test_a_step_is_given_up_at_its_share_of_the_grace() -> None:
    # SFT steps give up at once (share 0); RL updates once half the grace is gone; with no
    # grace known (no signal handlers) only share 0 gives up
    stop = StopRequest()
    assert not stop.overdue(0.0) and not stop.overdue(0.5)
    stop.request(signal.SIGINT)
    assert stop.overdue(0.0) and not stop.overdue(0.5)
    stop.grace_s = 30.0
    assert not stop.overdue(0.5)
    stop.at = time.monotonic() - 16.0
    assert stop.overdue(0.5) and not stop.overdue(0.6)
    with signal_handlers(StopRequest(), 7.0) as s2:  # the handlers set the grace they enforce
        assert s2.grace_s == 7.0


async def test_sigterm_becomes_a_request_and_the_old_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    with signal_handlers(stop, 30.0):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if stop.requested:
                break
            await asyncio.sleep(0.01)
        assert stop.name == "SIGTERM"
        with pytest.raises(RunStopped):
            stop.check()
    assert signal.getsignal(signal.SIGTERM) is before


_SAVER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from asyncrl.checkpoint import save_checkpoint
    from asyncrl.stopping import StopRequest, signal_handlers

    class SlowTrainer:
        def save_state(self, path):
            path.mkdir()
            (path / "weights.bin").write_bytes(b"x" * 1000)
            print("saving", flush=True)
            time.sleep(60)

    async def main(rd, grace):
        stop = StopRequest()
        with signal_handlers(stop, grace, describe=lambda: "DESCRIBED"):
            save_checkpoint(rd, 1, None, {"step": 1})
            await asyncio.to_thread(save_checkpoint, rd, 2, SlowTrainer(), {"step": 2})

    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2])))
""")


def _saver(tmp_path: Path, grace: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path), str(grace)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # log lines come first
        if line.strip() == "saving":
            return proc
    raise AssertionError(proc.communicate()[1][-3000:])


def _only_step_one_is_visible(rd: Path) -> None:
    assert [s for s, _ in list_checkpoints(rd)] == [1]
    assert latest_checkpoint(rd) == rd / "checkpoints" / "step_00000001"
    # the interrupted save is a hidden temp dir at most, never a step_* directory
    assert all(p.name.startswith(".tmp-") for p in (rd / "checkpoints").iterdir()
               if p.name != "step_00000001")


@pytest.mark.timeout(60)
def test_grace_running_out_during_a_save_exits_without_a_partial_checkpoint(tmp_path: Path
                                                                            ) -> None:
    proc = _saver(tmp_path, grace=1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert time.monotonic() - t0 < 10  # the save alone would take 60 s
    assert "did not finish within 1s" in err and "DESCRIBED" in err
    _only_step_one_is_visible(tmp_path)


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    proc = _saver(tmp_path, grace=60.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # the first one waits for the save (up to the grace period)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - t0 < 10
    assert "Ctrl-C again to stop at once" in err and "second SIGINT" in err
    _only_step_one_is_visible(tmp_path)


@pytest.mark.timeout(60)
def test_a_megatron_follower_outlives_the_signal_until_rank_zero_closes_it() -> None:
    pytest.importorskip("torch.distributed")
    code = textwrap.dedent("""
        import os, signal, time
        from asyncrl.trainer.megatron.launch import defer_stop_signals
        defer_stop_signals(1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        print("still serving", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert "still serving" in proc.stdout and "not reached" not in proc.stdout
    assert proc.returncode == 130  # the second Ctrl-C
    assert "follower_signal_deferred" in proc.stdout + proc.stderr
