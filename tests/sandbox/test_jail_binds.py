"""The jail's bind list: nested binds, and the VM failure they caused (issue 21).

On the lent 16-core VM the interpreter lives under /usr, so the bind list held /usr/lib (a
system library directory) and then /usr (sys.prefix). nsjail binds in order and then remounts
each destination read-only; /usr/lib, hidden under the later /usr bind, is no longer a mount
point and its remount fails with EINVAL. These tests rebuild that bind list here.
"""

from __future__ import annotations

import os

import pytest

from sandbox import PoolConfig, isolation

needs_nsjail = pytest.mark.skipif(isolation.find_nsjail() is None, reason="nsjail not found")


def test_a_bind_its_parent_already_shows_is_dropped():
    assert isolation.nest_binds([("/usr/lib", "/usr/lib"), ("/usr", "/usr")]) == [("/usr", "/usr")]


def test_a_nested_bind_with_other_content_comes_after_its_parent():
    binds = [("/srv/rt", "/usr/share/rt"), ("/usr", "/usr"), ("/lib64", "/lib64")]
    out = isolation.nest_binds(binds)
    assert out.index(("/usr", "/usr")) < out.index(("/srv/rt", "/usr/share/rt"))
    assert set(out) == set(binds)


def test_siblings_with_a_common_prefix_are_not_nested():
    binds = [("/usr/lib", "/usr/lib"), ("/usr/lib64", "/usr/lib64")]
    assert isolation.nest_binds(binds) == binds


def _as_if_python_under_usr(monkeypatch):
    real = isolation._python_binds()
    monkeypatch.setattr(isolation, "_python_binds", lambda: ["/usr", *real])


def test_no_bind_of_a_usr_python_is_hidden_under_a_later_one(monkeypatch):
    _as_if_python_under_usr(monkeypatch)
    dests = [d for _, d in isolation.jail_spec(PoolConfig()).ro_binds]
    for i, d in enumerate(dests):
        later = dests[i + 1:]
        assert not any(d != p and d.startswith(p.rstrip("/") + "/") for p in later), (d, dests)
    assert "/usr" in dests


@pytest.mark.parametrize("kind", ["nsjail", "bwrap"])
@pytest.mark.skipif(not os.path.isdir("/usr/lib"), reason="no /usr/lib here")
def test_the_jail_starts_with_the_bind_list_of_a_python_under_usr(monkeypatch, kind):
    """The VM's failure, reproduced with the real jail: the probe runs in it (bubblewrap, the
    fallback, remounts each bind as it makes it and never had the problem)."""
    if (isolation.find_nsjail() if kind == "nsjail" else isolation.find_bwrap()) is None:
        pytest.skip(f"{kind} not found")
    _as_if_python_under_usr(monkeypatch)
    res, err = isolation.probe_jail.__wrapped__(kind)
    assert res is not None, err
    assert not res.get("seccomp"), res


@needs_nsjail
def test_the_unnested_bind_list_fails_as_on_the_vm(monkeypatch):
    """Guards the reproduction itself: without the nesting fix nsjail refuses to start."""
    _as_if_python_under_usr(monkeypatch)
    monkeypatch.setattr(isolation, "nest_binds", lambda binds: binds)  # the old bind order
    res, err = isolation.probe_jail.__wrapped__("nsjail")
    assert res is None and "Invalid argument" in err, (res, err)

