"""Admission policies, as pure state machines: unit cases and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl.rollout.admission import (
    POLICIES,
    Ask,
    KvAwarePolicy,
    LeastRequestsPolicy,
    StaticPolicy,
    make_policy,
)


def ask(i: int | str, ctx: int = 10, rem: int = 90) -> Ask:
    return Ask(rollout_id=str(i), context_tokens=ctx, remaining_tokens=rem)


def test_kv_picks_the_engine_with_most_free_kv() -> None:
    p = KvAwarePolicy({"a": 1000, "b": 450})
    for i in range(8):
        p.submit(ask(i))  # reservation 100 each (worst case before any rollout finished)
    # a has the most free KV until it drops below b's 450
    assert [e for _, e in p.admit()] == ["a"] * 6 + ["b", "a"]
    assert p.free("a") == 300 and p.free("b") == 350


def test_head_of_line_waits_and_release_admits_it() -> None:
    p = KvAwarePolicy({"a": 200})
    p.submit(ask("big", 10, 150))
    p.submit(ask("next", 10, 150))
    p.submit(ask("small", 1, 1))
    assert p.admit() == [("big", "a")]
    assert p.queued() == ["next", "small"]  # "small" would fit but must not overtake
    p.release("big")
    assert p.admit() == [("next", "a"), ("small", "a")]


def test_a_lone_rollout_always_runs_even_if_larger_than_the_engine() -> None:
    p = LeastRequestsPolicy({"a": 50})
    p.submit(ask("huge", 10, 1000))
    assert p.admit() == [("huge", "a")]
    p.submit(ask("x", 1, 1))
    assert p.admit() == []


def test_reported_underuse_lowers_reservations_and_admits_more() -> None:
    p = KvAwarePolicy({"a": 1000}, decay=0.5, target=0.9, high=0.97)
    for i in range(30):
        p.submit(ask(i, 0, 100))
    assert len(p.admit()) == 10  # worst case first: 100 each
    assert p.ratio() == 1.0
    p.report("a", 200)  # the engine holds only 200 of its 1000 tokens while 20 wait
    assert p.ratio() == 0.5
    assert len(p.admit()) == 10  # 20 running now at 50 each = 1000
    assert p.estimate("a") <= 1000
    p.report("a", 990)  # about to overflow: back off at once
    assert p.ratio() == 0.75
    # one ratio for every engine
    two = KvAwarePolicy({"a": 1000, "b": 1000}, decay=0.5)
    for i in range(30):
        two.submit(ask(i, 0, 100))
    two.admit()
    two.report("a", 100)  # one engine's report below target moves the one shared ratio
    assert two.ratio() == 0.5
    assert p.admit() == []
    # with nobody waiting, low use is no reason to lower reservations
    q = KvAwarePolicy({"a": 1000}, decay=0.5)
    q.submit(ask(0))
    q.admit()
    q.report("a", 10)
    assert q.ratio() == 1.0


def test_reported_load_floors_the_estimate() -> None:
    p = KvAwarePolicy({"a": 1000, "b": 1000})
    p.submit(ask(0, 10, 90))
    p.admit()
    where = p.where("0")
    p.report(where, 950)  # the engine holds far more than we thought (another tenant, ...)
    assert p.estimate(where) == 950
    p.submit(ask(1))
    assert p.admit() == [("1", "b" if where == "a" else "a")]
    # least_requests and static ignore reports (baselines without correction)
    q = LeastRequestsPolicy({"a": 1000})
    q.submit(ask(0))
    q.admit()
    q.report("a", 999)
    assert q.estimate("a") == 100


def test_a_stale_report_can_raise_reservations_but_never_lower_them() -> None:
    # Load numbers a server refreshed a while ago may predate rollouts admitted since: an old
    # low reading must not shrink reservations (over-admission), an old high one still counts.
    p = KvAwarePolicy({"a": 1000}, decay=0.5, max_report_age_s=1.0)
    for i in range(30):
        p.submit(ask(i, 0, 100))
    assert len(p.admit()) == 10
    p.report("a", 200, age_s=5.0)
    assert p.ratio() == 1.0 and p.admit() == []
    p.report("a", 200, age_s=0.2)  # the same reading, fresh: reservations shrink
    assert p.ratio() == 0.5
    p.report("a", 990, age_s=5.0)  # old, but near overflow: back off anyway
    assert p.ratio() == 0.75
    # the floor: a stale report may raise it, never lower it
    q = KvAwarePolicy({"a": 1000}, max_report_age_s=1.0)
    q.submit(ask(0, 10, 90))
    q.admit()
    q.report("a", 800)
    q.report("a", 50, age_s=3.0)
    assert q.estimate("a") == 800
    q.report("a", 900, age_s=3.0)
    assert q.estimate("a") == 900
    q.report("a", 50)
    assert q.estimate("a") == 100  # fresh: the floor follows, the own estimate remains


def test_least_requests_balances_counts() -> None:
    p = LeastRequestsPolicy({"a": 10_000, "b": 300})
    for i in range(4):
        p.submit(ask(i))
    assert [e for _, e in p.admit()] == ["a", "b", "a", "b"]


def test_static_is_a_fixed_round_robin_split() -> None:
    p = StaticPolicy({"a": 200, "b": 200})
    for i in range(6):
        p.submit(ask(i))
    got = p.admit()
    assert sorted(got) == [("0", "a"), ("1", "b"), ("2", "a"), ("3", "b")]
    p.release("1")
    assert p.admit() == [("5", "b")]  # b's own queue; "4" waits for a


def test_static_engine_down_redeals_its_queue_and_reports_its_rollouts() -> None:
    p = StaticPolicy({"a": 100, "b": 100, "c": 100})
    for i in range(6):
        p.submit(ask(i))
    p.admit()
    lost = p.engine_down("a")
    assert lost == ["0"]
    assert "3" in p.queued()  # a's queued rollout moved to a live engine's queue
    for rid in lost:
        p.submit(ask(rid), front=True)
    for rid in ["1", "2"]:
        p.release(rid)
    admitted = dict(p.admit())
    assert set(admitted.values()) <= {"b", "c"} and {"0", "3"} & set(admitted)


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("kv", {"a": 1}), KvAwarePolicy)
    with pytest.raises(ValueError, match="least_requests"):
        make_policy("round_robin", {"a": 1})


# ------------------------------------------------------------------------------ properties
class AdmissionMachine(RuleBasedStateMachine):
    """Random submits, admissions, turns, releases, reports and engine deaths."""

    @initialize(kind=st.sampled_from(sorted(POLICIES)),
                caps=st.lists(st.integers(40, 600), min_size=1, max_size=4))
    def setup(self, kind: str, caps: list[int]) -> None:
        self.kind = kind
        opts = {"decay": 0.3} if kind == "kv" else {}
        self.p = make_policy(kind, {f"e{i}": c for i, c in enumerate(caps)}, **opts)
        self.n = 0
        self.asks: dict[str, Ask] = {}
        self.state: dict[str, str] = {}  # rid -> queued | running | done
        self.lost_and_requeued = 0

    @rule(ctx=st.integers(1, 80), rem=st.integers(0, 300))
    def submit(self, ctx: int, rem: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.asks[rid] = ask(rid, ctx, rem)
        self.p.submit(self.asks[rid])
        self.state[rid] = "queued"

    @rule()
    def admit(self) -> None:
        queued_before = self.p.queued()
        est = {e: self.p.estimate(e) for e in self.p.engines}
        count = {e: len(self.p.running(e)) for e in self.p.engines}
        ratio = self.p.ratio()
        got = self.p.admit()
        for rid, e in got:
            a = self.asks[rid]
            res = a.context_tokens + ratio * a.remaining_tokens
            # capacity is never exceeded, except by a rollout running alone
            assert count[e] == 0 or est[e] + res <= self.p.capacity(e) + 1e-6, (rid, e)
            assert e in self.p.alive()
            est[e] += res
            count[e] += 1
            assert self.state[rid] == "queued"
            self.state[rid] = "running"
        if self.kind != "static":  # one FIFO: admissions are a prefix of the queue
            assert [r for r, _ in got] == queued_before[: len(got)]

    @precondition(lambda self: any(s == "running" for s in self.state.values()))
    @rule(data=st.data(), frac=st.floats(0, 1))
    def turn(self, data: st.DataObject, frac: float) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, s in self.state.items() if s == "running")))
        a = self.asks[rid]
        d = int(a.remaining_tokens * frac)
        self.asks[rid] = ask(rid, a.context_tokens + d, a.remaining_tokens - d)
        self.p.progress(rid, a.context_tokens + d, a.remaining_tokens - d)

    @precondition(lambda self: any(s == "running" for s in self.state.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, s in self.state.items() if s == "running")))
        assert self.p.release(rid) is not None
        self.state[rid] = "done"

    @rule(data=st.data(), used=st.integers(0, 700))
    def report(self, data: st.DataObject, used: int) -> None:
        self.p.report(data.draw(st.sampled_from(self.p.engines)), used)

    @precondition(lambda self: len(self.p.alive()) >= 2)
    @rule(data=st.data())
    def engine_dies(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(self.p.alive()))
        lost = self.p.engine_down(e)
        for rid in lost:  # what the scheduler shell does: resume from the last turn, at the front
            assert self.state[rid] == "running"
            self.p.submit(self.asks[rid], front=True)
            self.state[rid] = "queued"
            self.lost_and_requeued += 1

    @invariant()
    def every_rollout_is_in_exactly_one_place(self) -> None:
        if not hasattr(self, "p"):
            return
        queued = self.p.queued()
        assert len(queued) == len(set(queued))
        running = [r for e in self.p.engines for r in self.p.running(e)]
        assert len(running) == len(set(running))
        assert not set(queued) & set(running)
        for rid, s in self.state.items():
            assert (rid in queued) == (s == "queued"), rid
            assert (rid in running) == (s == "running"), rid
            if s == "running":
                assert self.p.where(rid) in self.p.alive()
        for e in self.p.engines:
            if e not in self.p.alive():
                assert self.p.running(e) == []

    @invariant()
    def worst_case_policies_hold_capacity(self) -> None:
        if not hasattr(self, "p") or self.kind == "kv":
            return
        for e in self.p.engines:
            run = self.p.running(e)
            total = sum(self.asks[r].context_tokens + self.asks[r].remaining_tokens for r in run)
            assert len(run) <= 1 or total <= self.p.capacity(e)

    def teardown(self) -> None:
        if not hasattr(self, "p"):
            return
        # no starvation: finishing what runs and admitting again drains the whole queue
        for _ in range(len(self.state) + 2):
            for rid, s in list(self.state.items()):
                if s == "running":
                    self.p.release(rid)
                    self.state[rid] = "done"
            for rid, _e in self.p.admit():
                self.state[rid] = "running"
        assert all(s == "done" for s in self.state.values()), self.p.queued()


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_kv_hands_its_ratio_to_the_next_step() -> None:
    p = KvAwarePolicy({"a": 1000}, decay=0.5)
    for i in range(30):
        p.submit(ask(i, 0, 100))
    p.admit()
    p.report("a", 100)
    nxt = make_policy("kv", {"a": 1000}, **p.carry_over())
    assert nxt.ratio() == p.ratio() == 0.5
    assert StaticPolicy({"a": 1}).carry_over() == {}
