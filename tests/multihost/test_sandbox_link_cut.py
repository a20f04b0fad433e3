"""A sandbox host's link cut mid-run (network namespaces, `ip link set eth0 down` inside the
host: its packets are dropped, nobody sends a reset): the calls caught on it move to the other
sandbox node within the stall timeout, none is lost, and once the link is back the node is
probed back into rotation.

A client on host 0 sends waves of calls to nodes on hosts 1 and 2 and records when each call
started and ended; the cut and the repair are made from here, on the same monotonic clock.
`link_cut_run` is also what measures the failover time of another checkout's client
(`pythonpath=`), as docs/multinode.md reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import env, read_line, sandbox_node
from netns import Hosts

pytestmark = pytest.mark.timeout(120)

CLIENT = r"""
import asyncio, json, sys, time
from sandbox import ExecRequest, HttpSandboxClient

async def main():
    urls, token, kw, waves_s = sys.argv[1:3], open(sys.argv[3]).read().strip(), \
        json.loads(sys.argv[4]), float(sys.argv[5])
    records = []
    async with HttpSandboxClient(urls, token=token, **kw) as client:
        print("ready", flush=True)

        async def one(i):
            t0 = time.monotonic()
            r = await client.execute(ExecRequest(f"import time; time.sleep(1.0); print({i})",
                                                 "", 2.0))
            records.append({"start": t0, "end": time.monotonic(), "status": str(r.status),
                            "right": r.stdout == f"{i}\n", "detail": r.detail[:300]})

        calls, t_end, i = [], time.monotonic() + waves_s, 0
        while time.monotonic() < t_end:  # 4 calls every 0.2 s: both nodes always busy
            calls += [asyncio.ensure_future(one(i + k)) for k in range(4)]
            i += 4
            await asyncio.sleep(0.2)
        await asyncio.gather(*calls)
        up_at = None
        for _ in range(200):  # the cut node back in rotation (the link is repaired by now)
            if not any(getattr(n, "down", False) for n in client.nodes):
                up_at = time.monotonic()
                break
            await asyncio.sleep(0.05)
        print(json.dumps({"records": records, "issued": i, "up_at": up_at,
                          "stats": client.stats}), flush=True)

asyncio.run(main())
"""


def link_cut_run(net: Hosts, tmp: Path, *, client_kw: dict[str, Any], pythonpath: str = "",
                 cut_at_s: float = 2.0, repair_after_s: float = 3.0,
                 waves_s: float = 7.0) -> dict[str, Any]:
    """Nodes on hosts 1 and 2, the client on host 0; host 1's link cut `cut_at_s` after the
    client is ready and repaired `repair_after_s` later. Returns the client's report with
    `cut` (the monotonic time of the cut) added."""
    token = tmp / "sandbox.token"
    urls = [sandbox_node(net, 1, token), sandbox_node(net, 2, token)]
    extra = {"PYTHONPATH": pythonpath} if pythonpath else {}
    proc = net.spawn(0, [sys.executable, "-c", CLIENT, *urls, str(token), json.dumps(client_kw),
                         str(waves_s)],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                     env=env(**extra), cwd=tmp)  # not the checkout: `-c` imports from cwd
    assert read_line(proc, 60).strip() == "ready"
    # Host 0 keeps host 1's hardware address: as with a node behind a router, nothing tells
    # the client that the link is gone (otherwise its ARP entry fails after ~3 s and the
    # kernel reports "no route to host", which a client takes as a transport failure).
    mac = json.loads(net.run(1, ["ip", "-j", "link", "show", "eth0"]).stdout)[0]["address"]
    net.run(0, ["ip", "neigh", "replace", net.addr(1), "lladdr", mac, "dev", "eth0",
                "nud", "permanent"], check=True)
    time.sleep(cut_at_s)
    cut = time.monotonic()
    net.link(1, up=False)
    time.sleep(repair_after_s)
    net.link(1, up=True)
    logs = []  # the client's own log lines (sandbox_node_down / _up) come first
    while not (line := read_line(proc, 90)).startswith('{"records"'):
        assert line, f"the client ended without a report: {logs}"
        logs.append(line.strip())
    out = json.loads(line)
    out.update(cut=cut, logs=logs)
    return out


def test_a_cut_sandbox_link_fails_over_within_the_stall_timeout(netns_ok, tmp_path):
    with Hosts(3) as net:
        out = link_cut_run(net, tmp_path, client_kw={"call_timeout_s": 20.0})
    records, cut = out["records"], out["cut"]
    # nothing lost: every call issued has its own right answer, none a sandbox failure
    assert len(records) == out["issued"]
    assert all(r["status"] == "ok" and r["right"] for r in records), \
        [r for r in records if r["status"] != "ok"][:3]
    # the calls in flight at the cut finish on host 2 within the stall timeout (3 s) and a
    # re-run (1 s), not after call_timeout_s (20 s)
    caught = [r["end"] - cut for r in records if r["start"] < cut < r["end"]]
    assert caught and 3.0 < max(caught) < 7.0, caught  # > 3: some were on host 1
    assert out["stats"]["stalls"] >= 1 and out["stats"]["nodes_marked_down"] >= 1
    # repaired 3 s after the cut: probed back in rotation
    assert out["up_at"] is not None and out["stats"]["nodes_marked_up"] >= 1
    assert any("sandbox_node_down" in x and "198.18.0.2" in x for x in out["logs"]), out["logs"]
