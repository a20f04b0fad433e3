"""Stage rules: plateau detection, stage end, hard-problem selection."""

from __future__ import annotations

from asyncrl.algo.schedule import stage_lr
from asyncrl.config import PlateauRule, RolloutSection, StageSection
from asyncrl.stages import (
    PlateauState,
    hard_problem_ids,
    plateau_update,
    stage_budget,
    stage_done,
)


def test_plateau_needs_patience_evals_without_improvement() -> None:
    rule = PlateauRule(metric="eval/accuracy", patience=2, min_delta=0.01)
    st = PlateauState()
    seq = [0.1, 0.3, 0.305, 0.29, 0.5, 0.5, 0.5]
    flags = []
    for v in seq:
        st, flat = plateau_update(rule, st, {"eval/accuracy": v})
        flags.append(flat)
    # 0.305 is within min_delta of 0.3: no improvement; 0.29 second miss -> plateau
    assert flags == [False, False, False, True, False, False, True]
    st2, flat = plateau_update(rule, st, {"other": 1.0})
    assert st2 == st and not flat


def test_stage_done_by_steps_or_plateau() -> None:
    s = StageSection(name="a", steps=5)
    assert not stage_done(s, 4, plateaued=True)  # no rule: plateau ignored
    assert stage_done(s, 5, plateaued=False)
    s2 = StageSection(name="b", steps=5, plateau=PlateauRule())
    assert stage_done(s2, 1, plateaued=True)


def test_hard_problems_are_not_solved_k_of_k() -> None:
    assert hard_problem_ids({"a": 4, "b": 3, "c": 0}, k=4) == {"b", "c"}


def test_stage_overrides() -> None:
    r = RolloutSection(max_response_tokens=100, samples_per_prompt=4, group_size=2)
    assert stage_budget(r, StageSection(name="x", steps=1)) == 100
    assert stage_budget(r, StageSection(name="x", steps=1, max_response_tokens=50)) == 50
    assert stage_lr(StageSection(name="x", steps=1), 1e-6) == 1e-6
    assert stage_lr(StageSection(name="x", steps=1, lr=3e-4), 1e-6) == 3e-4


def test_lr_decays_linearly_over_the_last_steps() -> None:
    st = StageSection(name="x", steps=10, lr=1e-3, lr_decay_steps=4)
    lrs = [stage_lr(st, 1e-6, k) for k in range(10)]
    assert lrs[:7] == [1e-3] * 7  # steps 0-6 keep the stage's rate
    assert lrs[7:] == [1e-3 * 3 / 4, 1e-3 * 2 / 4, 1e-3 * 1 / 4]  # the last step still moves
    whole = StageSection(name="y", steps=4, lr_decay_steps=4)
    assert [stage_lr(whole, 1.0, k) for k in range(4)] == [1.0, 0.75, 0.5, 0.25]
