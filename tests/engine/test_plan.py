"""The local engine's batch planner without torch: KV budget, FIFO admission, preemption of the
newest, dead rows refilled before the batch grows, and compaction."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.engine.base import GenerateRequest, SamplingParams
from asyncrl.engine.local.plan import DONE, DRAIN_STEPS, RUNNING, WAITING, Plan, Planner, Seq


def seq(rid: str, n_input: int, max_new: int = 8) -> Seq:
    req = GenerateRequest(request_id=rid, input_ids=list(range(1, n_input + 1)),
                          sampling=SamplingParams(max_new_tokens=max_new))
    return Seq(req, asyncio.Queue(), None)


def planner(budget: int = 1000, max_running: int = 8, reserve: int = 0) -> Planner:
    return Planner(kv_token_budget=budget, max_running=max_running, admit_reserve=reserve)


def submit(pl: Planner, *seqs: Seq) -> None:
    pl.waiting.extend(seqs)


def step(pl: Planner, plan: Plan) -> None:
    """What the engine does with a plan: one token for every decoded and admitted request
    still running (one that left while the step ran gets none)."""
    for s in [plan.rows[i] for i in plan.decode] + plan.prefill:
        if s is not None and s.state == RUNNING:
            s.generated.append(7)
            pl.held += 1


def test_the_module_loads_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; import asyncrl.engine.local.plan; "
            "del sys.modules['torch']; assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)
    # the check can fail: the engine itself needs torch
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                              "import asyncrl.engine.local.batch"], capture_output=True)
    assert blocked.returncode != 0


def test_admits_in_order_and_appends_new_rows() -> None:
    pl = planner()
    a, b, c = seq("a", 5), seq("b", 3), seq("c", 4)
    submit(pl, a, b, c)
    plan = pl.plan(version=3)
    assert plan.prefill == [a, b, c] and plan.rows == [a, b, c]
    assert plan.decode == [] and plan.fill == [] and plan.compact is None
    assert plan.version == 3
    assert all(s.state == RUNNING for s in (a, b, c))
    assert [a.admit_order, b.admit_order, c.admit_order] == [0, 1, 2]
    assert pl.held == 5 + 3 + 4 and not pl.waiting
    step(pl, plan)
    nxt = pl.plan(version=3)
    assert nxt.decode == [0, 1, 2] and nxt.prefill == [] and pl.held == 15


def test_admission_needs_context_first_token_and_reserve_within_the_budget() -> None:
    pl = planner(budget=20, reserve=4)
    a = seq("a", 10, max_new=8)
    submit(pl, a)
    assert pl.plan(0).prefill == [a]  # 10 + 1 + 4 <= 20
    b = seq("b", 3, max_new=8)
    submit(pl, b)
    # projected 10 held + 1 decode token; b needs 3 + 1 + 4 more: 19 fits, 20 is the budget
    assert pl.plan(0).prefill == [b]
    c = seq("c", 1, max_new=8)
    submit(pl, c)
    # 13 held + 2 decode tokens + c's 1 + 1 + 4 = 21 > 20: c waits
    assert pl.plan(0).prefill == [] and list(pl.waiting) == [c] and c.state == WAITING


def test_the_reserve_is_capped_by_the_tokens_left_to_generate() -> None:
    pl = planner(budget=12, reserve=16)
    a = seq("a", 10, max_new=2)
    submit(pl, a)
    assert pl.plan(0).prefill == [a]  # 10 + 1 + min(2 - 1, 16) = 12


def test_strict_fifo_the_head_that_does_not_fit_blocks_smaller_ones() -> None:
    pl = planner(budget=30)
    submit(pl, seq("a", 20))
    pl.plan(0)
    big, small = seq("big", 15), seq("small", 2)
    submit(pl, big, small)
    plan = pl.plan(0)
    assert plan.prefill == [] and list(pl.waiting) == [big, small]


def test_max_running_caps_the_batch() -> None:
    pl = planner(max_running=2)
    seqs = [seq(str(i), 2) for i in range(4)]
    submit(pl, *seqs)
    assert pl.plan(0).prefill == seqs[:2]
    assert list(pl.waiting) == seqs[2:]
    assert pl.running == 2


def test_preempts_the_newest_when_the_next_decode_would_not_fit() -> None:
    pl = planner(budget=24)
    a, b, c = seq("a", 7), seq("b", 7), seq("c", 7)
    submit(pl, a, b, c)
    assert pl.plan(0).prefill == [a, b, c]  # 21 held, 3 more: 24
    pl.held += 3
    a.generated.append(1)
    b.generated.append(1)
    c.generated.append(1)  # 24 held: the next decode step needs 3 more
    plan = pl.plan(0)
    assert c.state == WAITING and list(pl.waiting) == [c] and c.preemptions == 1
    assert pl.preemptions == 1 and pl.held == 16
    assert plan.freed == [2] and plan.decode == [0, 1] and plan.rows[2] is None
    assert pl.held + len(plan.decode) <= pl.kv_token_budget


def test_preempted_request_goes_back_to_the_head_of_the_queue() -> None:
    pl = planner(budget=24)
    a, b = seq("a", 11), seq("b", 11)
    submit(pl, a, b)
    pl.plan(0)
    pl.held += 2
    a.generated.append(1)
    b.generated.append(1)
    late = seq("late", 1)
    submit(pl, late)
    pl.plan(0)
    assert list(pl.waiting) == [b, late]


def test_admitted_requests_fill_dead_rows_before_new_rows() -> None:
    pl = planner()
    seqs = [seq(str(i), 3) for i in range(4)]
    submit(pl, *seqs)
    pl.plan(0)
    pl.leave(seqs[1])
    pl.leave(seqs[3])
    assert pl.held == 6 and all(s.state == DONE for s in (seqs[1], seqs[3]))
    x, y, z = seq("x", 2), seq("y", 2), seq("z", 2)
    submit(pl, x, y, z)
    plan = pl.plan(0)
    assert plan.freed == [1, 3] and plan.decode == [0, 2]
    assert plan.fill == [1, 3] and plan.prefill == [x, y, z]
    assert plan.rows == [seqs[0], x, seqs[2], y, z] and plan.compact is None


def test_compacts_when_the_dead_outnumber_the_live() -> None:
    pl = planner()
    seqs = [seq(str(i), 3) for i in range(5)]
    submit(pl, *seqs)
    pl.plan(0)
    for i in (0, 1, 3):
        pl.leave(seqs[i])
    plan = pl.plan(0)
    assert plan.compact == [2, 4] and plan.rows == [seqs[2], seqs[4]]
    assert plan.freed == [] and plan.decode == [0, 1]


def test_a_draining_batch_is_compacted_after_drain_steps_plans() -> None:
    pl = planner()
    seqs = [seq(str(i), 3, max_new=100) for i in range(8)]
    submit(pl, *seqs)
    plan = pl.plan(0)
    pl.leave(seqs[0])  # one dead row of eight: not outnumbering, but an eighth
    plans = []
    for _ in range(DRAIN_STEPS + 1):
        step(pl, plan)
        plan = pl.plan(0)
        plans.append(plan)
    assert all(p.compact is None for p in plans[:-1])
    assert plans[-1].compact == list(range(1, 8)) and plans[-1].rows == seqs[1:]


def test_a_waiting_request_keeps_the_dead_row_from_draining() -> None:
    pl = planner(max_running=8, budget=200)
    seqs = [seq(str(i), 4, max_new=100) for i in range(8)]
    submit(pl, *seqs)
    plan = pl.plan(0)
    pl.leave(seqs[0])
    submit(pl, seq("big", 170))  # does not fit while the others run
    for _ in range(DRAIN_STEPS + 3):
        step(pl, plan)
        plan = pl.plan(0)
        assert plan.compact is None and plan.rows[0] is None and plan.prefill == []
    assert pl.preemptions == 0


def test_leave_removes_a_waiting_request_from_the_queue() -> None:
    pl = planner(max_running=1)
    a, b = seq("a", 2), seq("b", 2)
    submit(pl, a, b)
    pl.plan(0)
    pl.leave(b)
    assert not pl.waiting and b.state == DONE and pl.held == 2
    pl.leave(a)
    assert pl.held == 0 and pl.idle
    plan = pl.plan(0)  # its row stays until the next plan, which drops it: no live row left
    assert plan.compact == [] and plan.rows == [] and plan.decode == [] and plan.prefill == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
                min_size=1, max_size=25),
       st.integers(40, 120), st.integers(1, 6), st.integers(0, 8))
def test_any_traffic_keeps_the_budget_and_every_request_ends(reqs, budget, max_running,
                                                            reserve) -> None:
    """Requests arrive, decode and finish: held tokens never exceed the budget, equal what the
    running requests hold, each running request has one row, and every request completes."""
    pl = planner(budget=budget, max_running=max_running, reserve=reserve)
    arrivals = [(seq(str(i), n, m), at) for i, (n, m, at) in enumerate(reqs)
                if n + m <= budget]  # the engine refuses the others before the queue
    done: list[Seq] = []
    for t in range(2000):
        submit(pl, *(s for s, at in arrivals if at == t))
        plan = pl.plan(t)
        step(pl, plan)
        assert pl.held <= budget
        running = [s for s in plan.rows if s is not None and s.state == RUNNING]
        assert len(running) == len(set(map(id, running))) <= max_running
        assert pl.held == sum(s.held for s in running)
        for s in running:
            if len(s.generated) >= s.sampling.max_new_tokens:
                pl.leave(s)
                done.append(s)
        if len(done) == len(arrivals):
            break
    assert sorted(s.rid for s in done) == sorted(s.rid for s, _ in arrivals)
    assert all(len(s.generated) == s.sampling.max_new_tokens for s in done)
