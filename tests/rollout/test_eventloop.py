"""The event loop's collector policy: quiet while a run is in flight, bounded, restored after."""

from __future__ import annotations

import gc

import pytest

from asyncrl.rollout.eventloop import quiet_gc


class _Cycle:
    """A self-referencing object: only the cycle collector can free it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collections_seen():
    seen: list[int] = []

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)


def _churn(n: int) -> list[list[int]]:
    """Allocate and free `n` container objects while keeping ~500 alive at any time: the
    young-generation count stays low while the young list holds live objects (the shape of
    thousands of rollouts each waiting on a short-lived future)."""
    window: list[list[int]] = []
    for i in range(n):
        window.append([i])
        if len(window) > 500:
            window.pop(0)
    return window


def test_no_routine_collections_inside_and_thresholds_restored(collections_seen) -> None:
    before = gc.get_threshold()
    with quiet_gc():
        collections_seen.clear()
        keep = [[i] for i in range(20_000)]  # 20k net new containers: 28 young collections
        _churn(50_000)                        # at the stock threshold of 700
        assert collections_seen == []
        del keep
    assert gc.get_threshold() == before


def test_backstop_bounds_cyclic_garbage(collections_seen) -> None:
    with quiet_gc(backstop=5_000):
        collections_seen.clear()
        for _ in range(20_000):
            _Cycle()  # garbage that reference counting never frees
        # young ones only: what survives one is the run's live state, not traced again inside
        assert 3 <= len(collections_seen) <= 4 and set(collections_seen) == {0}
        # the backstop freed the cycles: what is left is under one backstop's worth
        assert sum(isinstance(o, _Cycle) for o in gc.get_objects()) < 5_000


def test_cycles_made_inside_are_freed_on_the_way_out() -> None:
    import weakref

    with quiet_gc():
        c = _Cycle()
        ref = weakref.ref(c)
        del c
        assert ref() is not None  # no collection ran
    assert ref() is None


def test_nested_use_keeps_the_outer_policy() -> None:
    before = gc.get_threshold()
    with quiet_gc(backstop=50_000):
        outer = gc.get_threshold()
        with quiet_gc(backstop=80_000):
            assert gc.get_threshold() == outer
        assert gc.get_threshold() == outer
    assert gc.get_threshold() == before


def test_overlapping_uses_that_end_out_of_order_restore_the_thresholds() -> None:
    """A training run's prefetched rollouts and an evaluation overlap, in either order."""
    before = gc.get_threshold()
    a, b = quiet_gc(), quiet_gc()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first one in leaves first
    assert gc.get_threshold()[2] >= 1 << 30  # still quiet: b is running
    b.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_collector_switched_off_by_the_user_stays_off() -> None:
    before = gc.get_threshold()
    gc.set_threshold(0)
    try:
        with quiet_gc():
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
