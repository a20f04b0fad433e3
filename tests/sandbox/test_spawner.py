"""The template spawner: C fork loop, light/main routing, trailing-expression fast path.

The adversarial and semantic tests run on the default spawner (templates) and, through
``any_pool``, on the Python fallback; these cover what is particular to the templates.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal

import pytest
from conftest import FAST, SECCOMP_MISSING
from sbx_helpers import assert_serves, run

from sandbox import PoolConfig, SandboxPool
from sandbox._runtime import child
from sandbox._runtime.controller import light_enough
from sandbox.errors import SandboxConfigError

try:
    from sandbox._runtime import _forkserver  # noqa: F401
    NO_C = ""
except ImportError as exc:  # built by `pip install` (needs a C compiler)
    NO_C = f"the C fork loop is not built: {exc}"
needs_c = pytest.mark.skipif(bool(NO_C), reason=NO_C)

LIGHT = frozenset({"math", "sys", "fractions", "collections", "itertools", "random"})


@pytest.mark.parametrize("code, light", [
    ("print(1+1)", True),
    ("import math, sys\nprint(math.pi)", True),
    ("from fractions import Fraction as F", True),
    ("from collections.abc import Mapping", True),
    ("def f():\n    import itertools\n    return 1", True),
    ("# uses numpy later, maybe\nprint('numpy')", True),  # text, not an import
    ("important = 1\nfromage = 2", True),
    ("import numpy as np; print(np.pi)", False),
    ("x = 1\nfrom sympy import *", False),
    ("import math as m, numpy", False),
    ("import os", False),  # not in this light set
    ("__import__('math')", False),  # dynamic imports are not followed
    ("import importlib", False),
    ("exec('import numpy')", False),
])
def test_routing_follows_the_imports_the_text_shows(code, light):
    assert light_enough(code, LIGHT) is light


def _reference(code: str) -> str:
    """What the program prints under the AST rule (the last statement, if an expression,
    has its non-None repr printed)."""
    import ast
    tree = ast.parse(code)
    last = tree.body.pop().value if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out = io.StringIO()
    g: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<string>", "exec"), g)
        if last is not None:
            v = eval(compile(ast.Expression(last), "<string>", "eval"), g)
            if v is not None:
                print(repr(v))
    return out.getvalue()


PROGRAMS = [
    "print(1+1)", "x=5\nx*2", "x = 1\nx  # comment\n", "é = 3\né * 2", "x = 'é'; x + 'ü'",
    "'''multi\nline''' + 'x'", "[i for i in\nrange(3)]", "def f():\n    return 3\nf()",
    "import math\nmath.pi", "try:\n  x=1\nexcept Exception:\n  x=2\nx", "x=1; x+1",
    "a = 1\n(a +\n 2)", "42", "x=1\n42", "None", "if True:\n    7", "for i in range(3): i",
    "with open('/dev/null') as f:\n    f.read()", "class C:\n    def __exit__(s, *a): return False\n"
    "    def __enter__(s): return s\nwith C():\n    pass", "x = [1]\nx.append(2)",
    "import sys\nsys.stdout.write('a')", "x = 1 + \\\n  2\nx", "print(1)\n\n\n", "x = (1,\n2)\n",
    "import sys\nsys.displayhook = lambda v: print('hook', v)\nx = 5\nx",
    # a constant last statement is dropped by the compiler: the POP_TOP before it is another's
    "import math\nmath.sqrt(16)\n7", "import math\nmath.sqrt(16)\n'the answer is 7'",
    "x = [3]\nx.pop()\n...", "print(1)\n42", "x = [3]\nx.pop()\nTrue  # done\n", "x = 2\nx; 7",
    "x = 2\nx\n# the end\n\n", "x = 2\nx\npass",
]


@pytest.mark.parametrize("code", PROGRAMS)
def test_the_trailing_expression_fast_path_prints_what_the_ast_rule_prints(code):
    import sys

    saved = (child._prepared_main, sys.displayhook, sys.modules["__main__"], sys.argv,
             list(sys.path))
    try:
        child.prepare_main()
        body, tail = child.split_trailing_expression(code)
        out = io.StringIO()
        g: dict = {"__name__": "__main__"}
        with contextlib.redirect_stdout(out):
            exec(body, g)
            if tail is not None:
                v = eval(tail, g)
                if v is not None:
                    print(repr(v))
        assert out.getvalue() == _reference(code)
    finally:  # prepare_main re-points the interpreter's __main__, argv and path[0]
        child._prepared_main, sys.displayhook, sys.modules["__main__"], sys.argv = saved[:4]
        sys.path[:] = saved[4]


@needs_c
@pytest.mark.asyncio(loop_scope="session")
async def test_programs_fork_from_the_template_their_imports_need(jail_pool):
    info = jail_pool.describe()
    assert info["spawner"] == "template" and info["light_template"], info
    r = await run(jail_pool, "import sys\nprint('numpy' in sys.modules, 'sympy' in sys.modules)")
    assert r.stdout == "False False\n", r  # the light template
    r = await run(jail_pool, "import numpy, sys\nprint('sympy' in sys.modules)")
    assert r.stdout == "True\n", r  # the main one, with every preload
    # a program routed to the light template still gets what it imports dynamically
    r = await run(jail_pool, "m = 'num' + 'py'\nnp = __import__(m)\nprint(np.arange(3).sum())")
    assert r.stdout == "3\n", r


@needs_c
@pytest.mark.asyncio(loop_scope="session")
async def test_the_light_template_reseeds_random_per_call(jail_pool):
    outs = {(await run(jail_pool, "import random; print(random.random())")).stdout
            for _ in range(4)}
    assert len(outs) == 4


@needs_c
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.skipif(bool(SECCOMP_MISSING), reason="needs seccomp")
async def test_a_dead_template_takes_its_worker_down_and_the_pool_replaces_it():
    cfg = dict(FAST, workers=1, isolation="seccomp")  # no jail: template pids are host pids
    async with SandboxPool(PoolConfig(**cfg)) as pool:
        info = pool._workers[0].info
        assert info["spawner"] == "template"
        slow = asyncio.ensure_future(run(pool, "import time; time.sleep(1.5)"))
        await asyncio.sleep(0.3)
        os.kill(info["light"]["pid"], signal.SIGKILL)
        r = await asyncio.wait_for(slow, 10)
        assert r.status == "sandbox_failure", r
        for _ in range(50):  # the replacement worker starts in the background
            if pool.describe()["workers_ready"] == 1:
                break
            await asyncio.sleep(0.1)
        await assert_serves(pool)
        assert pool.metrics.worker_restarts >= 1


def _serving_libraries(pid: int) -> set[str]:
    """msgspec's, epoll's (``select``) and the socket module's extensions, as far as process
    ``pid`` maps them: {"msgspec", "select", "_socket"} at most."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if len(line.split()) >= 6}
    found = {"msgspec" for p in paths if "/msgspec/" in p}
    return found | {name for p in paths for name in ("select", "_socket")
                    if p.rsplit("/", 1)[-1].startswith(name + ".")}


@needs_c
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.skipif(bool(SECCOMP_MISSING), reason="needs seccomp")
async def test_templates_never_map_msgspec_epoll_or_sockets():
    """Every mapping of the process children fork from costs every fork and exit: the
    templates load only their preloads and our runtime, never what the controller serves
    with. (No preload of the main template's own, so any such library would be ours.)"""
    cfg = dict(FAST, workers=1, isolation="seccomp", preload=())  # host pids, as above
    async with SandboxPool(PoolConfig(**cfg)) as pool:
        info = pool._workers[0].info
        assert info["spawner"] == "template"
        # the controller maps all three: on this build they are libraries the check can see
        assert _serving_libraries(info["controller_pid"]) == {"msgspec", "select", "_socket"}
        assert _serving_libraries(info["pid"]) == set()  # the main template
        assert _serving_libraries(info["light"]["pid"]) == set()


@pytest.mark.asyncio(loop_scope="session")
async def test_calls_run_below_the_worker(jail_pool):
    """Children run at nice 10 and the worker at 0 (nsjail's default would be 19 for all),
    so a CPU-bound call cannot hold back the process that must kill it."""
    r = await run(jail_pool, "import os; print(os.getpriority(os.PRIO_PROCESS, 0))")
    assert r.stdout == "10\n", r


def test_the_c_fork_loop_is_built_where_there_is_a_compiler():
    """The extension is optional at install (no compiler: the Python spawner), so a C error
    would otherwise pass silently as a slower sandbox."""
    import shutil
    import sysconfig
    has_cc = shutil.which("cc") or shutil.which("gcc")
    has_headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (has_cc and has_headers):
        pytest.skip("no C compiler or Python headers here")
    assert not NO_C, NO_C


def test_the_fast_path_opcodes_are_this_pythons():
    import opcode
    import sys
    if sys.version_info[:2] != (3, 11):
        assert child._PRINT_EXPR is None
        return
    assert (child._POP_TOP, child._LOAD_CONST, child._RETURN_VALUE, child._PRINT_EXPR) == (
        opcode.opmap["POP_TOP"], opcode.opmap["LOAD_CONST"], opcode.opmap["RETURN_VALUE"],
        opcode.opmap["PRINT_EXPR"])


def test_spawner_is_validated():
    with pytest.raises(SandboxConfigError, match="spawner"):
        PoolConfig(spawner="fork")
