"""The sandbox as a service: a `sandbox serve` node with a token, and a client of it.

    python examples/sandbox_http.py

On a cluster the node runs on a CPU machine (`asyncrl sandbox serve --host 0.0.0.0
--token-file FILE`) and the trainer connects with `remote_sandbox([url], token=...)`; here the
node is a subprocess on loopback.
"""

import asyncio
import os
import secrets
import sys

from asyncrl import remote_sandbox, run_loop
from sandbox import AuthError


async def main() -> None:
    token = secrets.token_hex(32)
    node = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sandbox", "serve", "--port", "0", "--workers", "1",
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "SANDBOX_TOKEN": token})
    try:
        assert node.stdout is not None
        ready = (await asyncio.wait_for(node.stdout.readline(), 60)).decode()
        url = ready.split()[3]  # "sandbox serving on http://127.0.0.1:PORT ..."
        print("node up:", "auth=token" in ready)
        async with remote_sandbox([url], token=token) as python:
            out = await python({"code": "print(2 ** 100)"})
            print("call:", out.status.value, out.stdout.strip())
            outs = await asyncio.gather(*(python({"code": f"print({i} * {i})"}) for i in range(5)))
            print("batch:", [o.stdout.strip() for o in outs])
        try:
            async with remote_sandbox([url], token="not-the-token" * 3):
                pass
        except AuthError as e:
            print("wrong token refused:", type(e).__name__)
    finally:
        node.terminate()
        await node.wait()


if __name__ == "__main__":
    run_loop(main())
