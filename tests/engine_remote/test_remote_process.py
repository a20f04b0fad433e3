"""Launched servers: a real child process (the fake SGLang server run as a program).

Covers what only a process can show: launch flags and logs, no orphans on close or when the
orchestrator is SIGKILLed, a server that exits mid-stream being relaunched with the latest
weights, a failed launch reported with its log.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
from remote_helpers import FAST, eventually, make_request

from asyncrl.config import SGLangEngineConfig
from asyncrl.engine.base import WeightUpdate, collect
from asyncrl.engine.remote.process import port_is_free
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.fleet import open_sglang_engines
from asyncrl.errors import EngineUnavailable

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py"
REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Running, not a zombie (a reparented child may wait a moment for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def options(tmp_path: Path):
    return msgspec.structs.replace(FAST, launcher=(sys.executable, str(FAKE)),
                                   log_dir=str(tmp_path / "engines"))


def base_port() -> int:
    return random.randint(21000, 29000)  # other test runs share this machine


async def test_launch_serves_logs_and_leaves_no_process(session, tmp_path):
    cfg = SGLangEngineConfig(base_port=base_port(), num_servers=2, tp_size=2,
                             mem_fraction_static=0.5)
    async with open_sglang_engines(cfg, session=session, model_path="/fake/m",
                                   remote_options=options(tmp_path)) as engines:
        assert [e.name for e in engines] == ["sglang-0", "sglang-1"]
        assert all(e.launched and e.healthy for e in engines)
        pids = [e.process.pid for e in engines]
        for e in engines:
            g = await collect(e, make_request(max_new=5))
            assert len(g.token_ids) == 5
        argv = engines[1].process.argv
        assert argv[argv.index("--base-gpu-id") + 1] == "2"  # its own GPU group
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.5"
        assert "--enable-metrics" in argv and "--incremental-streaming-output" in argv
    assert not any(alive(p) for p in pids)
    log = (tmp_path / "engines" / "sglang-0.log").read_text()
    assert "fake sglang serving /fake/m" in log


async def test_server_exiting_mid_stream_is_relaunched_with_latest_weights(session, tmp_path):
    weights = tmp_path / "step-2"
    weights.mkdir()
    cfg = SGLangEngineConfig(base_port=base_port(), extra_args=[
        "--fake-crash-after-tokens", "40", "--fake-token-delay", "0.005"])
    async with open_sglang_engines(cfg, session=session, model_path="/fake/m",
                                   remote_options=options(tmp_path)) as (eng,):
        await eng.update_weights(WeightUpdate(version=2, path=str(weights)))
        first_pid = eng.process.pid
        with pytest.raises(EngineUnavailable):
            await collect(eng, make_request(max_new=100))
        await eventually(lambda: eng.healthy and eng.process.pid != first_pid, 30)
        assert not alive(first_pid)
        argv = eng.process.argv
        assert argv[argv.index("--model-path") + 1] == str(weights)  # not the base model
        assert eng.policy_version == 2
        g = await collect(eng, make_request(max_new=5))
        assert len(g.token_ids) == 5 and g.finish_reason == "length"


async def test_failed_launch_reports_exit_code_and_log(session, tmp_path):
    cfg = SGLangEngineConfig(base_port=base_port())
    opts = msgspec.structs.replace(options(tmp_path), launcher=(
        sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"))
    eng = SGLangEngine(cfg, index=0, session=session, port=cfg.base_port, model_path="/fake/m",
                       options=opts)
    with pytest.raises(EngineUnavailable, match=r"rc=3[\s\S]*CUDA out of memory"):
        await eng.start()
    await eng.close()


def test_servers_die_with_a_killed_orchestrator(tmp_path):
    port = base_port()
    while not port_is_free("127.0.0.1", port):
        port += 1
    parent = textwrap.dedent(f"""
        import asyncio, os, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from asyncrl.engine.remote.process import ServerProcess

        async def main():
            p = ServerProcess([sys.executable, {str(FAKE)!r}, "--model-path", "/fake/m",
                               "--port", "{port}"], env=dict(os.environ),
                              log_path=Path({str(tmp_path / "orphan.log")!r}), name="orphan")
            await p.start()
            print("CHILD", p.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("CHILD"):  # skip the log lines
            line = proc.stdout.readline()
            assert line, "the orchestrator exited early"
        child = int(line.split()[1])
        deadline = time.monotonic() + 20
        while port_is_free("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)  # the server is up and listening
        assert alive(child)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code runs in the orchestrator
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_planned_relaunches_do_not_spend_the_crash_restart_budget(session, tmp_path):
    # vLLM's tied-embedding weight update relaunches the server every step; those relaunches
    # must leave the restart budget (3 here) for real crashes
    cfg = SGLangEngineConfig(base_port=base_port())
    async with open_sglang_engines(cfg, session=session, model_path="/fake/m",
                                   remote_options=options(tmp_path)) as (eng,):
        for i in range(FAST.max_restarts + 2):
            await eng.relaunch(f"planned relaunch {i}")
            assert eng.healthy
        pid = eng.process.pid
        os.kill(pid, signal.SIGKILL)  # a real crash: still within the budget
        await eventually(lambda: eng.healthy and eng.process.pid != pid, 30)
        g = await collect(eng, make_request(max_new=3))
        assert len(g.token_ids) == 3
