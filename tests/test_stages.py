"""Stage rules: plateau detection, stage end, hard-problem selection, a stage's source mix."""

from __future__ import annotations

import pytest

from asyncrl.algo.schedule import stage_lr
from asyncrl.config import PlateauRule, RolloutSection, StageSection
from asyncrl.errors import ConfigError
from asyncrl.records import Problem
from asyncrl.stages import (
    PlateauState,
    hard_problem_ids,
    plateau_update,
    stage_budget,
    stage_done,
    stage_problems,
)
from asyncrl.tasks.stream import source_counts, source_mix


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


def _problems(**counts: int) -> list[Problem]:
    """`counts` problems of each source (`rg/a`: a reasoning-gym-like name), interleaved."""
    out = []
    for source, n in counts.items():
        out += [Problem(id=f"{source}-{i}", question="?", answer="1",
                        source=source.replace("_", "/")) for i in range(n)]
    return sorted(out, key=lambda p: int(p.id.rsplit("-", 1)[1]))


def test_a_source_mix_leaves_problems_out_to_reach_the_weights_shares() -> None:
    probs = _problems(rg_gsm=320, rg_eq=80, other=50)
    even = source_mix(probs, {"gsm": 1, "eq": 1}, seed=0, stage=1)  # a key: a last part
    assert source_counts(even) == {"rg/eq": 80, "rg/gsm": 80}  # `other` left out
    assert [p.id for p in even] == [p.id for p in probs if p in even]  # in list order
    # seeded by the run, the stage and the source: a resume's, whatever the keys' order
    assert even == source_mix(probs, {"eq": 1, "gsm": 1}, seed=0, stage=1, key="other")
    assert even != source_mix(probs, {"gsm": 1, "eq": 1}, seed=1, stage=1)
    assert even != source_mix(probs, {"gsm": 1, "eq": 1}, seed=0, stage=2)
    tilted = source_mix(probs, {"rg/eq": 3, "rg/gsm": 1, "other": 0.5}, seed=0, stage=0)
    assert source_counts(tilted) == {"other": 13, "rg/eq": 80, "rg/gsm": 27}  # full names
    # a named source keeps one problem however small its weight
    assert source_counts(source_mix(probs, {"eq": 1, "gsm": 0.001}, seed=0, stage=0)) == {
        "rg/eq": 80, "rg/gsm": 1}
    assert source_mix(probs, {}, seed=0, stage=0) == probs


def test_a_source_mix_that_names_no_source_or_one_twice_is_a_config_error() -> None:
    probs = _problems(rg_gsm=4, rg_eq=4)
    with pytest.raises(ConfigError, match=r"stages\[1\].source_weights: \['gsm_symbolic'\] name "
                       r"no source.*'rg/eq', 'rg/gsm'"):
        source_mix(probs, {"gsm": 1, "gsm_symbolic": 1}, seed=0, stage=1,
                   key="stages[1].source_weights")
    with pytest.raises(ConfigError, match="all name the source 'rg/gsm'"):
        source_mix(probs, {"gsm": 1, "rg/gsm": 1}, seed=0, stage=0)


def test_a_stage_trains_on_its_mix_then_on_what_its_hard_filter_kept() -> None:
    probs = _problems(rg_gsm=8, rg_eq=2)
    stage = StageSection(name="rl", steps=1, source_weights={"eq": 1, "gsm": 1})
    mixed = stage_problems(probs, stage, 0, 3, None)
    assert source_counts(mixed) == {"rg/eq": 2, "rg/gsm": 2}
    assert mixed == source_mix(probs, stage.source_weights, seed=0, stage=3)
    outside = next(p.id for p in probs if p not in mixed)
    kept = [mixed[0].id, mixed[3].id, outside]  # an id outside the mix stays out
    assert stage_problems(probs, stage, 0, 3, kept) == [mixed[0], mixed[3]]
    assert stage_problems(probs, None, 0, 3, None) == probs
