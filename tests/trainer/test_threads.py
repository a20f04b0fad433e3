"""The trainer's thread tuner: fast threads on an idle machine, one thread when others want
the CPU, and back again when they stop; probes rare while nothing changes."""

from __future__ import annotations

import pytest

from asyncrl.trainer.threads import ThreadTuner

# ms per tiny SFT step on 2 cores (bench/sft_step.py): idle, and beside one busy process
IDLE = {2: 0.34, 1: 0.55}
BUSY = {2: 3.5, 1: 0.64}


def drive(tuner: ThreadTuner, machine: dict[int, float], steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        n = tuner.threads()
        tuner.record(n, machine[n])
        used.append(n)
    return used


def test_an_idle_machine_keeps_every_thread_and_probes_ever_more_rarely() -> None:
    tuner = ThreadTuner(most=2)
    used = drive(tuner, IDLE, 2000)
    assert tuner.current == 2
    probes = [i for i, n in enumerate(used) if n == 1]
    assert len(probes) <= 25          # about 1% of the steps at the slower count
    assert probes[-1] - probes[-2] >= 100   # and rarer as they keep losing
    cost = sum(IDLE[n] for n in used) / (IDLE[2] * len(used))
    assert cost < 1.01


def test_a_busy_machine_moves_to_one_thread_and_back_when_it_is_idle_again() -> None:
    tuner = ThreadTuner(most=2)
    drive(tuner, IDLE, 300)           # long idle: probes are rare by now
    used = drive(tuner, BUSY, 100)    # another program starts
    assert tuner.current == 1 and used.index(1) <= 4   # noticed within a few steps
    assert sum(BUSY[n] for n in used) / len(used) < 1.5 * BUSY[1]
    used = drive(tuner, IDLE, 200)    # and stops: at one thread only a probe can tell
    assert tuner.current == 2 and used[-50:].count(2) >= 49


def test_many_cores_halve_until_the_step_is_fastest() -> None:
    machine = {16: 2.0, 8: 1.0, 4: 0.6, 2: 0.8, 1: 1.4}   # a busy 16-core machine
    tuner = ThreadTuner(most=16)
    drive(tuner, machine, 200)
    assert tuner.current == 4


def test_the_first_step_of_each_count_is_not_timed() -> None:
    tuner = ThreadTuner(most=2, first_probe=2)
    tuner.record(2, 100.0)            # warm-up: one-off allocations, not a change of load
    tuner.record(2, 0.34)
    assert tuner.threads() == 2
    tuner.record(2, 0.34)
    assert tuner.threads() == 1       # two timed steps: the first probe
    with pytest.raises(ValueError):
        ThreadTuner(most=0)
