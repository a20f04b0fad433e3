"""The harness itself: hosts reach each other only by their 198.18.0.x addresses, a cut link
cuts them off, and nothing (namespace, interface, process) outlives the harness, also when
the test body fails."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from netns import Hosts, our_namespaces

pytestmark = pytest.mark.timeout(120)

# Listen on ADDR:PORT, accept one connection, send back its peer's address.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(); s.settimeout(30)
print("listening", flush=True)
c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
print(c.recv(100).decode())
"""


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its (foreign) parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def serve(net: Hosts, i: int) -> subprocess.Popen:
    p = net.spawn(i, [sys.executable, "-c", SERVER, net.addr(i)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "listening"
    return p


def test_hosts_reach_each_other_by_address(hosts):
    serve(hosts, 1)
    r = hosts.run(0, [sys.executable, "-c", CLIENT, hosts.addr(1), "10"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "198.18.0.1"  # the server saw host 0's own address
    ip = hosts.run(1, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert "198.18.0.2/24" in ip


def test_a_host_does_not_see_the_machines_network(hosts):
    links = hosts.run(0, ["ip", "-o", "link"]).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == [
        "eth0", "lo"]


def test_a_cut_link_cuts_the_host_off(hosts):
    serve(hosts, 1)
    hosts.link(1, up=False)
    r = hosts.run(0, [sys.executable, "-c", CLIENT, hosts.addr(1), "2"])
    assert r.returncode != 0
    hosts.link(1, up=True)
    # a veth brought back up takes a moment to forward again (its bridge port, the neighbour
    # entry): the link is restored when a connection gets through within a few tries
    for _ in range(10):
        r = hosts.run(0, [sys.executable, "-c", CLIENT, hosts.addr(1), "3"])
        if r.returncode == 0:
            break
        time.sleep(0.5)
    assert r.returncode == 0, r.stderr


def test_nothing_is_left_behind_even_when_the_body_fails(netns_ok):
    before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    with pytest.raises(RuntimeError, match="body failed"), Hosts(3) as net:
        assert len(our_namespaces(net.prefix)) == 4  # three hosts and the switch
        sleeper = net.spawn(2, [sys.executable, "-c", "import time; time.sleep(600)"])
        # a grandchild that leaves the process group still dies with its namespace
        orphan = net.run(2, ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"]).stdout
        assert alive(int(orphan))
        raise RuntimeError("body failed")
    assert our_namespaces(net.prefix) == []
    assert sleeper.poll() is not None
    assert not alive(int(orphan))
    after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert after.count("\n") == before.count("\n")  # no interface appeared on the machine
