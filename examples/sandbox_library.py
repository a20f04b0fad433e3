"""The sandbox as a library: a pool of contained Python workers in this process.

    python examples/sandbox_library.py

`local_sandbox()` yields the Python tool the model calls (`python_code_with_standard_io`);
calling it directly with a dict of arguments is how you test a tool. `tool.client` is the
sandbox client underneath (`execute(ExecRequest(...))`), for programs of your own.
"""

from asyncrl import local_sandbox, run_loop
from sandbox import ExecRequest


async def main() -> None:
    async with local_sandbox(workers=1, time_limit_s=1.0) as python:
        print("isolation:", "jail" if "jail" in python.client.isolation else "process")
        for code, stdin in [("print(sum(range(10)))", ""),
                            ("print(input()[::-1])", "stressed"),
                            ("1 / 0", ""),
                            ("while True: pass", "")]:
            out = await python({"code": code, "input": stdin})
            last = (out.stdout or out.stderr).strip().splitlines()[-1:] or [""]
            print(f"{code!r}: {out.status.value} {last[0]}")
        res = await python.client.execute(ExecRequest(code="import math; print(math.factorial(20))"))
        print("client:", res.status, res.stdout.strip(), f"exit={res.exit_code}")


if __name__ == "__main__":
    run_loop(main())
