"""What a tool call means: the workloads, stdin, notebook-style repr, output cap, exit codes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from sbx_helpers import assert_serves, run

from sandbox import ExecRequest

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(60)]

WORKLOADS = Path(__file__).resolve().parents[2] / "bench" / "tool-workloads.json"
EXPECTED_STDOUT = {
    "W1-trivial": "2\n",
    "W2-numpy": None,  # a float close to 8
    "W3-sympy": "(x - 1)*(x + 1)*(x**2 + 1)\n",
    "W4-cpu50ms": f"{sum(range(650000))}\n",
    "W5-stdin": "10\n",
    "W6-error": "",
    "W7-timeout": "",
}


def _workloads():
    # shipped in the repository (bench/README.md says where it came from): never skipped
    data = json.loads(WORKLOADS.read_text())
    return data["time_limit_s"], data["workloads"]


async def test_standard_workloads_give_expected_status_and_output(jail_pool):
    limit, workloads = _workloads()
    for w in workloads:
        t_limit = 1.0 if w["expect"] == "timeout" else limit
        r = await run(jail_pool, w["code"], w["input"], t_limit)
        assert r.status == w["expect"], (w["id"], r)
        want = EXPECTED_STDOUT[w["id"]]
        if want is None:
            assert abs(float(r.stdout) - 8.0) < 1e-9, r
        else:
            assert r.stdout == want, (w["id"], r)
        if w["expect"] == "error":
            assert "ZeroDivisionError" in r.stderr and r.exit_code == 1
        if w["expect"] == "timeout":
            assert 1.0 <= r.duration_s < 2.0, r


async def test_stdin_is_the_call_input(jail_pool):
    r = await run(jail_pool, "import sys\nlines = sys.stdin.read().splitlines()\n"
                             "print(len(lines), lines[-1])", "a\nb\nlast line\n")
    assert r.stdout == "3 last line\n"
    r = await run(jail_pool, "print(input() + '!')", "hi\n")
    assert r.stdout == "hi!\n"
    big = "7\n" * 200_000  # larger than a pipe buffer
    r = await run(jail_pool, "import sys; print(sum(map(int, sys.stdin)))", big)
    assert r.stdout == "1400000\n"


async def test_last_expression_repr_is_printed_like_a_notebook(jail_pool):
    r = await run(jail_pool, "x = 21\nx * 2")
    assert r.stdout == "42\n"
    r = await run(jail_pool, "'text'")
    assert r.stdout == "'text'\n"  # repr, not str
    r = await run(jail_pool, "import sympy as sp\nsp.Rational(1, 3) + sp.Rational(1, 6)")
    assert r.stdout == "1/2\n"
    r = await run(jail_pool, "print('side effect')")  # value None: nothing more
    assert r.stdout == "side effect\n"
    r = await run(jail_pool, "x = 5")  # not an expression
    assert r.stdout == ""
    r = await run(jail_pool, "for i in range(2):\n    i\n")  # expression not at top level
    assert r.stdout == ""


async def test_each_call_is_a_fresh_main_program(jail_pool):
    r = await run(jail_pool, "leak = 123\nimport math\nmath.tau = 0\n"
                             "print(__name__, __name__ == '__main__')")
    assert r.stdout == "__main__ True\n"
    r = await run(jail_pool, "import math\nprint('leak' in globals(), math.tau > 6)")
    assert r.stdout == "False True\n"
    r = await run(jail_pool, "import sys; print(sys.argv)")
    assert r.stdout == "['-c']\n"


async def test_numpy_and_random_are_reseeded_per_call(jail_pool):
    code = "import numpy as np, random; print(np.random.rand(), random.random())"
    outs = {(await run(jail_pool, code)).stdout for _ in range(4)}
    assert len(outs) == 4


async def test_exit_codes_and_errors(jail_pool):
    r = await run(jail_pool, "import sys; sys.exit(3)")
    assert (r.status, r.exit_code) == ("error", 3)
    r = await run(jail_pool, "import sys; print('bye'); sys.exit(0)")
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "bye\n")
    r = await run(jail_pool, "raise SystemExit('fatal message')")
    assert r.status == "error" and "fatal message" in r.stderr
    r = await run(jail_pool, "def f(:\n  pass")
    assert r.status == "error" and r.stderr.startswith('  File "<string>", line 1')
    assert "SyntaxError" in r.stderr and "ast.py" not in r.stderr  # like `python -c`
    r = await run(jail_pool, "print('before'); raise ValueError('boom')")
    assert r.status == "error" and r.stdout == "before\n"
    assert r.stderr.startswith("Traceback") and "ValueError: boom" in r.stderr
    assert "zygote" not in r.stderr and "child.py" not in r.stderr  # our frames are hidden


async def test_output_is_capped_keeping_head_and_tail(jail_pool):
    cap = jail_pool.config.max_output_bytes
    r = await run(jail_pool, "print('HEAD'); print('x' * 1_000_000); print('TAIL')")
    assert r.status == "ok" and r.truncated
    assert r.stdout.startswith("HEAD\n") and r.stdout.endswith("TAIL\n")
    assert "bytes of output omitted" in r.stdout
    assert len(r.stdout) < cap + 200
    r = await run(jail_pool, "import sys; sys.stderr.write('e' * 100000)")
    assert r.truncated and len(r.stderr) < cap + 200
    r = await run(jail_pool, "print('short')")
    assert not r.truncated


async def test_files_live_in_a_private_working_dir_for_one_call(jail_pool):
    r = await run(jail_pool, "import os, tempfile\nopen('notes.txt', 'w').write('hello')\n"
                             "print(open('notes.txt').read())\n"
                             "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
                             "    f.write('t')\n"
                             "print(os.path.dirname(f.name) == os.getcwd())")
    assert (r.status, r.stdout) == ("ok", "hello\nTrue\n"), r
    r = await run(jail_pool, "import os; print(os.path.exists('notes.txt'), os.listdir('.'))")
    assert r.stdout == "False []\n"


async def test_time_limit_per_request_and_cap(jail_pool):
    r = await run(jail_pool, "import time; time.sleep(0.6); print('done')", limit=0.3)
    assert r.status == "timeout" and r.duration_s < 1.0
    r = await run(jail_pool, "print('fine')", limit=10_000)
    assert r.status == "ok" and "capped" in r.detail


async def test_hundreds_of_concurrent_calls_all_answered(jail_pool):
    reqs = [ExecRequest(f"print({i} * {i})") for i in range(300)]
    results = await asyncio.gather(*(jail_pool.execute(r) for r in reqs))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(300)]
    mixed = [ExecRequest("1/0"), ExecRequest("print(1)"), ExecRequest("while True: pass", "", 0.5)]
    results = await jail_pool.execute_many(mixed * 20)
    assert Counter(r.status for r in results) == {"error": 20, "ok": 20, "timeout": 20}
    await assert_serves(jail_pool)


async def test_seccomp_level_runs_the_same_programs(seccomp_pool):
    r = await run(seccomp_pool, "import sympy as sp; x = sp.symbols('x'); sp.expand((x+1)**2)")
    assert (r.status, r.stdout) == ("ok", "x**2 + 2*x + 1\n")
    assert seccomp_pool.isolation == "seccomp"
