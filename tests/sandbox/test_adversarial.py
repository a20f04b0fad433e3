"""One attack per test. Each asserts the attack was contained *and* the pool serves the next call.

Destructive attacks run only in the jail (at lower levels some of them would hit this host).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from conftest import HOST_SECRET, needs_jail
from sbx_helpers import assert_serves, run

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(60)]

PROJECT_FILE = os.path.abspath(__file__)


def _zygote_pids(pool) -> list[int | None]:
    return [w["pid"] for w in pool.describe()["workers"]]


# ----------------------------------------------------------------------------- network
@needs_jail
async def test_network_socket_creation_is_denied(jail_pool):
    r = await run(jail_pool, "import socket\ns = socket.socket()\nprint('GOT SOCKET')")
    assert r.status == "error" and "PermissionError" in r.stderr and "GOT" not in r.stdout
    await assert_serves(jail_pool)


@needs_jail
async def test_network_dns_lookup_fails(jail_pool):
    r = await run(jail_pool, "import socket\nprint(socket.getaddrinfo('pypi.org', 443))")
    assert r.status == "error" and "pypi" not in r.stdout
    await assert_serves(jail_pool)


async def test_network_connect_to_loopback_server_never_arrives(any_pool):
    pool = any_pool
    connections = []

    async def on_conn(reader, writer):
        connections.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "s.sendall(b'hello')\nprint('CONNECTED')")
        r = await run(pool, code)
        await asyncio.sleep(0.1)
    finally:
        server.close()
        await server.wait_closed()
    assert r.status == "error" and "CONNECTED" not in r.stdout
    assert connections == []
    await assert_serves(pool)


@needs_jail
async def test_ctypes_raw_syscalls_are_filtered(jail_pool):
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for name, nr, args in [('socket', 41, (2, 1, 0)), ('fork', 57, ()), ('execve', 59, (0, 0, 0)),
                       ('unshare', 272, (0x10000000,)), ('mount', 165, (0, 0, 0, 0, 0)),
                       ('ptrace', 101, (16, 1, 0, 0)), ('bpf', 321, (0, 0, 0)),
                       ('io_uring_setup', 425, (1, 0)), ('setns', 308, (0, 0)),
                       ('clone_process', 56, (17, 0, 0, 0, 0))]:
    rc = libc.syscall(nr, *args)
    out[name] = (rc, ctypes.get_errno())
print(out)
assert all(rc == -1 and err == 1 for rc, err in out.values()), out
print('ALL DENIED')
"""
    r = await run(jail_pool, code)
    assert r.status == "ok" and "ALL DENIED" in r.stdout, r
    await assert_serves(jail_pool)


# ----------------------------------------------------------------------------- files
async def test_writing_outside_the_work_dir_fails(any_pool):
    pool = any_pool
    targets = ["/tmp/escape.txt", "/usr/escape.txt", "/etc/escape.txt", "/root/escape.txt",
               "../escape.txt", os.path.dirname(PROJECT_FILE) + "/escape.txt"]
    code = (f"import os\nok = []\nfor t in {targets!r}:\n    try:\n        open(t, 'w').write('x')\n"
            "        ok.append(t)\n    except OSError as e:\n        pass\n"
            "open('inside.txt', 'w').write('fine')\nprint('WROTE', ok)")
    r = await run(pool, code)
    assert (r.status, r.stdout) == ("ok", "WROTE []\n"), r
    host_paths = [t for t in targets if not t.startswith("..")]
    assert not any(map(os.path.exists, host_paths))
    await assert_serves(pool)


async def test_host_secrets_are_not_readable(any_pool):
    pool = any_pool
    code = f"""
import os, glob
found = []
if {HOST_SECRET!r} in repr(dict(os.environ)): found.append('environ')
for path in ['/proc/1/environ', '/proc/self/environ', '/proc/%d/environ' % os.getppid(),
             '/root/.bashrc', {PROJECT_FILE!r}, '/etc/passwd', '/etc/shadow']:
    try:
        data = open(path, 'rb').read()
        found.append(path)
    except OSError:
        pass
for d in ['/root', '/work', '/home', {os.path.dirname(PROJECT_FILE)!r}]:
    try:
        os.listdir(d); found.append(d)
    except OSError:
        pass
print('FOUND', found)
"""
    r = await run(pool, code)
    assert r.status == "ok", r
    leaked = r.stdout.split("FOUND", 1)[1]
    # /proc/self/environ is the call's own (clean) environment; nothing else may be readable
    assert leaked.strip() in ("[]", "['/proc/self/environ']"), r.stdout
    assert HOST_SECRET not in r.stdout + r.stderr
    await assert_serves(pool)


@needs_jail
async def test_deleting_files_the_next_call_needs_fails(jail_pool):
    code = """
import os, numpy, sympy, json, shutil
hits = []
for path in [numpy.__file__, json.__file__, os.__file__, sympy.__file__]:
    try:
        os.remove(path); hits.append(path)
    except OSError:
        pass
for d in [os.path.dirname(json.__file__), os.path.dirname(os.__file__) + '/encodings', '/opt']:
    shutil.rmtree(d, ignore_errors=True)
print('REMOVED', hits)
"""
    r = await run(jail_pool, code)
    assert (r.status, r.stdout) == ("ok", "REMOVED []\n"), r
    r = await run(jail_pool, "import json, numpy; print(json.dumps(numpy.arange(3).tolist()))")
    assert r.stdout == "[0, 1, 2]\n"
    await assert_serves(jail_pool)


@needs_jail
async def test_filling_tmp_and_work_dir_is_bounded_and_cleaned(jail_pool):
    code = """
import os
written = 0
try:
    open('/tmp/fill', 'wb')
    print('TMP WRITABLE')
except OSError:
    pass
try:
    i = 0
    while True:
        with open(f'big{i}', 'wb') as f:
            for _ in range(64):
                f.write(b'x' * (1 << 20)); written += 1
        i += 1
except OSError as e:
    print('stopped', type(e).__name__, written)
"""
    r = await run(jail_pool, code, limit=5.0)
    assert "TMP WRITABLE" not in r.stdout
    assert r.status in ("ok", "timeout"), r
    r = await run(jail_pool, "open('f', 'wb').write(b'y' * (8 << 20)); import os; "
                             "print(os.path.getsize('f'), sorted(os.listdir('.')))")
    assert (r.status, r.stdout) == ("ok", "8388608 ['f']\n"), r
    await assert_serves(jail_pool)


@needs_jail
async def test_reading_another_calls_work_dir_fails(jail_pool):
    writer = asyncio.ensure_future(run(jail_pool, "import time\nopen('secret.txt','w').write("
                                                  "'other-call-secret')\ntime.sleep(1.5)\n"
                                                  "print('writer done')", limit=3))
    await asyncio.sleep(0.5)
    spy = """
import os, glob
seen = []
try:
    seen += os.listdir('/tmp')
except OSError:
    pass
for w in range(4):
    for n in range(1, 5000):
        try:
            seen.append(open(f'/tmp/w{w}-{n}/secret.txt').read())
        except OSError:
            pass
print('SEEN', seen)
"""
    r = await run(jail_pool, spy, limit=3)
    assert (r.status, r.stdout) == ("ok", "SEEN []\n"), r
    assert (await writer).stdout == "writer done\n"
    await assert_serves(jail_pool)


# ----------------------------------------------------------------------------- processes
async def test_another_calls_results_never_reach_a_calls_output(any_pool):
    # Many short calls at once: answers of finished calls are waiting to be sent while the
    # next children are forked. A child forked from the process that buffers those answers
    # (the Python shape) once flushed them into its own stdout: other calls' results leaked.
    from sandbox import ExecRequest

    for _ in range(3):
        results = await any_pool.execute_many([ExecRequest(f"{i} ** 2") for i in range(150)])
        assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n")
                                                           for i in range(150)]
    await assert_serves(any_pool)


@needs_jail
async def test_fork_bomb_is_stopped_at_the_first_fork(jail_pool):
    code = "import os\nn = 0\nwhile True:\n    os.fork()\n    n += 1"
    t0 = time.monotonic()
    r = await run(jail_pool, code, limit=2)
    assert r.status == "error" and "PermissionError" in r.stderr, r
    assert time.monotonic() - t0 < 1.5
    r = await run(jail_pool, "import multiprocessing as mp\np = mp.Process(target=print)\n"
                             "p.start()\np.join()\nprint('STARTED')")
    assert r.status == "error" and "STARTED" not in r.stdout
    await assert_serves(jail_pool)


@needs_jail
async def test_spawning_a_shell_fails(jail_pool):
    code = ("import os, subprocess\nrc = os.system('echo pwned-by-system')\nprint('system', rc)\n"
            "subprocess.run(['/bin/sh', '-c', 'echo pwned-by-sh'])\n")
    r = await run(jail_pool, code)
    assert r.status == "error" and "pwned" not in r.stdout, r
    await assert_serves(jail_pool)


async def test_os_exec_is_denied(any_pool):
    pool = any_pool
    r = await run(pool, "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', "
                        "'print(\"EXECED\")'])")
    assert r.status == "error" and "PermissionError" in r.stderr and "EXECED" not in r.stdout
    await assert_serves(pool)


@needs_jail
async def test_killing_the_zygote_and_other_processes_fails(jail_pool):
    before = _zygote_pids(jail_pool)
    code = """
import os, signal
hits = []
me = os.getpid()
for pid in [os.getppid(), 1, -1] + list(range(2, 400)):
    if pid == me:
        continue
    try:
        os.kill(pid, signal.SIGKILL); hits.append(pid)
    except (PermissionError, ProcessLookupError):
        pass
try:
    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL); hits.append('pg')
except (PermissionError, ProcessLookupError):
    pass
print('KILLED', hits)
"""
    r = await run(jail_pool, code)
    assert (r.status, r.stdout) == ("ok", "KILLED []\n"), r
    await assert_serves(jail_pool)
    assert _zygote_pids(jail_pool) == before  # no worker had to be replaced


@needs_jail
async def test_ptrace_and_zygote_memory_are_out_of_reach(jail_pool):
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ppid = os.getppid()
rc = libc.ptrace(16, ppid, 0, 0)  # PTRACE_ATTACH
print('ptrace', rc, ctypes.get_errno())
for path in [f'/proc/{ppid}/mem', f'/proc/{ppid}/environ', f'/proc/{ppid}/maps']:
    try:
        open(path, 'rb').read(16)
        print('READ', path)
    except OSError as e:
        pass
"""
    r = await run(jail_pool, code)
    assert r.status == "ok" and r.stdout == "ptrace -1 1\n", r
    await assert_serves(jail_pool)


# ----------------------------------------------------------------------------- resources
@needs_jail
async def test_memory_bomb_is_killed_by_the_limit(jail_pool):
    r = await run(jail_pool, "x = bytearray(8 * 1024 ** 3)\nprint('ALLOCATED')")
    assert r.status == "killed" and "memory" in r.detail and "ALLOCATED" not in r.stdout, r
    r = await run(jail_pool, "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",
                  limit=10)
    assert r.status == "killed" and "memory" in r.detail, r
    await assert_serves(jail_pool)


@needs_jail
async def test_infinite_loop_times_out_on_the_wall_clock(jail_pool):
    t0 = time.monotonic()
    r = await run(jail_pool, "while True:\n    pass", limit=1.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 2.0, r
    await assert_serves(jail_pool)


@needs_jail
async def test_cpu_burn_with_threads_times_out(jail_pool):
    code = ("import threading\ndef burn():\n    while True:\n        pass\n"
            "ts = [threading.Thread(target=burn) for _ in range(8)]\n"
            "[t.start() for t in ts]\nprint('started', flush=True)\n[t.join() for t in ts]")
    t0 = time.monotonic()
    r = await run(jail_pool, code, limit=1.0)
    assert r.status == "timeout" and r.stdout in ("", "started\n"), r  # printing is best effort
    assert time.monotonic() - t0 < 2.0  # the time limit + 1 s
    await assert_serves(jail_pool)


@needs_jail
async def test_huge_output_is_capped_not_buffered(jail_pool):
    cap = jail_pool.config.max_output_bytes
    r = await run(jail_pool, "import sys\nwhile True:\n    sys.stdout.write('z' * 65536)",
                  limit=1.0)
    assert r.status == "timeout" and r.truncated, r
    assert len(r.stdout) < cap + 200 and "omitted" in r.stdout
    r = await run(jail_pool, "import os\nos.write(2, b'e' * (200 << 20))", limit=4)
    assert r.status == "ok" and r.truncated and len(r.stderr) < cap + 200, r
    await assert_serves(jail_pool)


@needs_jail
async def test_background_threads_do_not_outlive_the_call(jail_pool):
    code = ("import threading, time\ndef late():\n    time.sleep(0.3)\n    print('LATE', flush=True)\n"
            "threading.Thread(target=late, daemon=True).start()\nprint('main done')")
    r = await run(jail_pool, code)
    assert (r.status, r.stdout) == ("ok", "main done\n"), r
    await asyncio.sleep(0.5)
    r = await run(jail_pool, "print('next')")
    assert r.stdout == "next\n"
    r = await run(jail_pool, "import threading, time\nthreading.Thread(target=time.sleep, "
                             "args=(100,)).start()\nprint('waiting on a non-daemon thread')",
                  limit=0.5)
    assert r.status == "timeout"  # like a real interpreter, exit waits for it
    assert jail_pool.inflight == 0
    await assert_serves(jail_pool)
