"""The run's `[sandbox] kind = "remote"` section reaching a token-guarded node: the token is
read from `token_file` (or `token_env`) and sent; a bad one is a config error naming the key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import pytest

from asyncrl import config
from asyncrl.errors import ConfigError
from asyncrl.runtime import open_sandbox
from sandbox import AuthError, ExecRequest

pytestmark = pytest.mark.timeout(120)
TOKEN = "run-config-token-" + "5e" * 16


@contextlib.asynccontextmanager
async def node_with_token():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--port", "0", "--workers", "1",
        "--isolation", "seccomp", "--preload", "math", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "SANDBOX_TOKEN": TOKEN})
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert "auth=token" in line, line
        yield line.split()[3]
    finally:
        proc.kill()
        await proc.wait()


def run_config(sandbox: dict) -> config.RunConfig:
    return config.from_dict({"model": {"init": {"model_type": "qwen3"}},
                             "data": {"train": "generator:tiny_math"},
                             "stages": [{"name": "s1", "steps": 1}], "sandbox": sandbox})


@pytest.mark.slow  # the reward checker's pool imports numpy, sympy and math-verify
async def test_the_remote_section_sends_the_token_from_its_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with node_with_token() as url:
        cfg = run_config({"kind": "remote", "urls": [url], "token_file": str(token_file),
                          "stall_timeout_s": 7.5})
        async with open_sandbox(cfg) as (client, _):
            r = await client.execute(ExecRequest("print(2**10)"))
            assert client.stall_timeout_s == 7.5  # the section's failover setting reaches it
        assert (r.status, r.stdout) == ("ok", "1024\n")

        monkeypatch.setenv("MY_SANDBOX_TOKEN", "x" * 32)
        cfg = run_config({"kind": "remote", "urls": [url], "token_env": "MY_SANDBOX_TOKEN"})
        with pytest.raises(AuthError, match="refused"):
            async with open_sandbox(cfg):
                pass


async def test_a_bad_token_file_is_a_config_error_naming_the_key(tmp_path):
    cfg = run_config({"kind": "remote", "urls": ["http://127.0.0.1:9"],
                      "token_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match=r"sandbox\.token_file"):
        async with open_sandbox(cfg):
            pass
