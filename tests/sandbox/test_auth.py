"""Authentication of a sandbox node: token sources, the bind rule, and real servers refusing
unauthenticated callers without running their code (``sandbox.auth`` states the policy)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from sandbox import AuthError, ExecRequest, HttpSandboxClient
from sandbox.auth import check, is_loopback, load_token, require_token_for
from sandbox.errors import SandboxConfigError
from sandbox.wire import JSON, MSGPACK

pytestmark = pytest.mark.timeout(90)

TOKEN = "t0ken-for-tests-" + "9f3a" * 8


# Test servers take traffic on loopback only (no test sends to another address of this machine
# or any other). A node enforces a configured token the same whatever address it is bound to,
# and the bind rule itself (a non-loopback bind without a token refuses to start) is tested
# below, so a token-guarded node on loopback is the cluster node's behaviour.
REMOTE_HOST = "127.0.0.1"


# ----------------------------------------------------------------------------- pure rules
def test_token_comes_from_a_file_before_the_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    env = {"SANDBOX_TOKEN": "other-token-" + "x" * 20}
    assert load_token(str(f), "SANDBOX_TOKEN", environ=env) == TOKEN
    assert load_token(None, "SANDBOX_TOKEN", environ=env) == env["SANDBOX_TOKEN"]
    assert load_token(None, "SANDBOX_TOKEN", environ={}) is None


def test_bad_tokens_are_refused_with_the_source_named(tmp_path):
    with pytest.raises(SandboxConfigError, match="token file"):
        load_token(str(tmp_path / "absent"))
    with pytest.raises(SandboxConfigError, match=r"SANDBOX_TOKEN.*at least 16"):
        load_token(None, "SANDBOX_TOKEN", environ={"SANDBOX_TOKEN": "short"})
    with pytest.raises(SandboxConfigError, match="whitespace"):
        load_token(None, "T", environ={"T": "two words but long enough"})


def test_only_loopback_binds_may_go_without_a_token():
    for host in ("127.0.0.1", "::1", "localhost", "127.3.4.5"):
        assert is_loopback(host), host
        require_token_for(host, None)
    for host in ("0.0.0.0", "::", "", "192.0.2.2", "10.1.2.3"):
        assert not is_loopback(host), host
        with pytest.raises(SandboxConfigError, match="refusing to bind"):
            require_token_for(host, None)
        require_token_for(host, TOKEN)


def test_header_verdicts():
    t = TOKEN.encode()
    assert check(f"Bearer {TOKEN}", t) == "ok"
    assert check(f"bearer {TOKEN}", t) == "ok"
    assert check(None, t) == check("", t) == "missing"
    assert check(f"Bearer {TOKEN}x", t) == "wrong"
    assert check(f"Basic {TOKEN}", t) == "wrong"
    assert check("Bearer \udcff", t) == "wrong"  # undecodable header bytes are no crash


# ----------------------------------------------------------------------------- real nodes
@contextlib.asynccontextmanager
async def node(host: str, *extra: str, env: dict[str, str] | None = None):
    """``python -m sandbox serve`` bound to ``host`` at isolation ``none`` (so that code which
    ran would leave its marker file on this machine)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--host", host, "--port", "0",
        "--workers", "1", "--isolation", "none", "--preload", "math", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})})
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("sandbox serving on "), (line, await proc.stderr.read())
        yield proc, line.split()[3]
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _marker_code(path: Path) -> str:
    return f"open({str(path)!r}, 'w').write('ran'); print('ran')"


async def test_a_non_loopback_node_without_a_token_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "SANDBOX_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--host", "0.0.0.0", "--port", "0",
        "--isolation", "none", "--preload", "math", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"refusing to bind" in err, (out, err)
    assert b"sandbox serving" not in out


async def test_unauthenticated_requests_never_execute_code(tmp_path):
    marker = tmp_path / "marker"
    batch = {"requests": [{"code": _marker_code(marker)}]}
    async with node(REMOTE_HOST, env={"SANDBOX_TOKEN": TOKEN}) as (_, url), \
            aiohttp.ClientSession() as http:
        assert url.startswith(f"http://{REMOTE_HOST}:")
        attempts = [({}, JSON, msgspec.json.encode(batch)),
                    ({"Authorization": "Bearer " + "x" * len(TOKEN)}, JSON,
                     msgspec.json.encode(batch)),
                    ({"Authorization": f"Bearer {TOKEN[:-1]}"}, MSGPACK,
                     msgspec.msgpack.encode(batch)),
                    ({"Authorization": f"Basic {TOKEN}"}, JSON, msgspec.json.encode(batch))]
        for headers, ctype, body in attempts:
            async with http.post(url + "/v1/execute", data=body,
                                 headers={"Content-Type": ctype, **headers}) as resp:
                assert resp.status == 401, (headers, await resp.read())
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        await asyncio.sleep(0.3)  # had anything been queued, it would have run by now
        assert not marker.exists()

        async with http.get(url + "/metrics") as resp:
            assert resp.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(url + "/metrics", headers=auth) as resp:
            text = await resp.text()
        assert "sandbox_http_rejected_auth_missing_total 2" in text, text
        assert "sandbox_http_rejected_auth_wrong_total 3" in text, text
        assert "sandbox_call_latency_seconds_count 0" in text, text  # no call reached the pool

        # positive control: the same call with the token does run
        async with http.post(url + "/v1/execute", data=msgspec.json.encode(batch),
                             headers={"Content-Type": JSON, **auth}) as resp:
            assert resp.status == 200
            assert (await resp.json())["results"][0]["stdout"] == "ran\n"
        assert marker.read_text() == "ran"


async def test_health_is_open_but_says_little_to_anonymous_callers():
    async with node(REMOTE_HOST, env={"SANDBOX_TOKEN": TOKEN}) as (_, url), \
            aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok", "isolation": "none", "auth": "token"}
        async with http.get(url + "/health", headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401
        async with http.get(url + "/health",
                            headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            info = await resp.json()
            assert info["workers_ready"] == 1 and info["auth"] == "token"


async def test_the_client_sends_its_token_and_a_wrong_one_fails_at_open(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    marker = tmp_path / "marker"
    async with node(REMOTE_HOST, "--token-file", str(token_file)) as (proc, url):
        with pytest.raises(AuthError, match="refused"):
            async with HttpSandboxClient([url], token="w" * 32):
                pass
        with pytest.raises(AuthError, match="requires a token"):
            async with HttpSandboxClient([url]):
                pass
        assert not marker.exists()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # noqa: ASYNC240 (tiny procfs read)
        assert TOKEN.encode() not in cmdline
        async with HttpSandboxClient([url], token=TOKEN) as client:
            code = _marker_code(marker) + "\nimport os; print(sorted(os.environ))"
            r = await client.execute(ExecRequest(code))
        assert r.status == "ok" and marker.read_text() == "ran", r
        assert "SANDBOX_TOKEN" not in r.stdout and TOKEN not in r.stdout


async def test_a_node_without_a_token_on_loopback_serves_as_before():
    env = {"SANDBOX_TOKEN": ""}
    async with node("127.0.0.1", env=env) as (_, url), HttpSandboxClient([url]) as client:
        r = await client.execute(ExecRequest("print(6*7)"))
        assert (r.status, r.stdout) == ("ok", "42\n")
