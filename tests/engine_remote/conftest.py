"""Fixtures for the remote-engine tests: an aiohttp session, and the real sglang-router
0.3.2 (its own process per test module; skipped when the package is not installed)."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def _router_python() -> str:
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable
    venv = ROOT / ".venv-router" / "bin" / "python"
    if venv.exists():
        return str(venv)
    pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2, here or "
                "in .venv-router)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[str]:
    python = _router_python()
    port = _port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    proc = subprocess.Popen(
        [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
         str(port), "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(_port()), "--worker-startup-check-interval", "1",
         "--health-check-interval-secs", "1", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sglang-router did not start (rc={proc.poll()}), see {log.name}")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
