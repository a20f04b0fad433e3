"""Helpers shared by the sandbox tests (importable as ``sbx_helpers``)."""

from __future__ import annotations

from sandbox import ExecRequest, ExecResult, SandboxPool


async def run(pool: SandboxPool, code: str, stdin: str = "",
              limit: float | None = None) -> ExecResult:
    return await pool.execute(ExecRequest(code, stdin, limit))


async def assert_serves(pool: SandboxPool) -> None:
    """The pool still answers an ordinary call correctly (after an attack)."""
    r = await run(pool, "import numpy as np; print(int(np.arange(5).sum()) + 1)")
    assert (r.status, r.stdout) == ("ok", "11\n"), r
