"""The distributed weight sync across two hosts (network namespaces, `netns.py`): the SGLang
fake runs on host 1 and joins a gloo group with trainer rank 0 on host 0
(`weight_push.py`, `asyncrl.weightsync.group.WeightGroup`).

- the group forms at the address host 0 has on the route to the server (198.18.0.1, found,
  not configured), and two pushes of several buckets land exactly;
- host 1's link cut in the middle of a push (a silent server: no connection error to see):
  the push ends within the deadlines, naming the server, and the server is taken out.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import env, read_line
from netns import Hosts

HERE = Path(__file__).resolve().parent
FAKE = HERE.parent / "fakes" / "sglang_server.py"

pytestmark = pytest.mark.timeout(120)


def fake_on(net: Hosts, host: int) -> str:
    proc = net.spawn(host, [sys.executable, str(FAKE), "--host", net.addr(host), "--port",
                            "0", "--model-path", "/fake/model"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     env=env(GLOO_SOCKET_IFNAME="eth0"))  # as a server's host must set it
    m = re.search(r"(http://[\d.]+:\d+)", read_line(proc, 30))
    assert m, "the fake did not print its URL"
    return m.group(1)


def trainer_on(net: Hosts, host: int, url: str, log: Path, *args: str
               ) -> subprocess.Popen[Any]:
    with log.open("w") as f:  # the child holds its own copy of the descriptor
        return net.spawn(host, [sys.executable, str(HERE / "weight_push.py"), url, *args],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True,
                         env=env())


def result(proc: subprocess.Popen[Any], timeout: float, log: Path) -> dict[str, Any]:
    line = read_line(proc, timeout)
    assert line, f"the trainer exited with {proc.wait(5)}: {log.read_text()[-3000:]}"
    return dict(json.loads(line))


def test_trainer_on_one_host_pushes_to_a_server_on_another(hosts, tmp_path):
    url, log = fake_on(hosts, 1), tmp_path / "trainer.log"
    out = result(trainer_on(hosts, 0, url, log), 60, log)
    # host 0's address on the route to host 1
    assert out.get("master_address") == hosts.addr(0), (out, log.read_text()[-3000:])
    for v in (1, 2):
        push = out[f"push{v}"]
        assert push["failed"] == [] and push["exact"], push
        assert push["buckets"] == 4 and push["bytes"] == 4 * 64 * 64 * 4
        assert push["server_version"] == str(v) and push["engine_version"] == v
    assert out["healthy"]


def test_a_cut_link_mid_push_fails_it_naming_the_server(hosts, tmp_path):
    url, log = fake_on(hosts, 1), tmp_path / "trainer.log"
    proc = trainer_on(hosts, 0, url, log, "--hold-at-bucket", "2")
    assert read_line(proc, 60).strip() == "holding 2"  # push 1 is done, push 2 is under way
    hosts.link(1, up=False)
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out = result(proc, 60, log)
    assert out["push1"]["exact"] and out["push1"]["failed"] == []
    push = out["push2"]
    assert [n for n, _ in push["failed"]] == ["sglang-0"], push
    # the group's 3 s or the update's 6 s deadline, then the session end and the resume
    # (2 s each) that cannot reach the server either
    assert push["seconds"] < 6 + 2 * 2 + 3, push
    assert push["engine_version"] == 1 and not out["healthy"]
