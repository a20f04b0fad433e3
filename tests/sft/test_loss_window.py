"""An SFT stage's logged loss is the token-weighted mean over the steps since the last row, not
one batch's, and a run stopped between rows (its state saved and read back) writes the rows an
unstopped run writes."""

from __future__ import annotations

import random

import msgspec
import pytest

from asyncrl.sft.stage import step_row
from asyncrl.stages import TrainState


def _steps(n: int) -> list[dict[str, float]]:
    rng = random.Random(0)
    return [{"sft/loss": rng.uniform(0.5, 3.0), "sft/tokens": float(rng.randint(50, 400)),
             "sft/grad_norm": rng.random()} for _ in range(n)]


def _rows(steps: list[dict[str, float]], state: TrainState, first: int = 1,
          stop_at: int | None = None) -> tuple[list[dict[str, float]], TrainState]:
    rows = []
    for i, m in enumerate(steps[first - 1:stop_at], start=first):
        row = step_row(state, m, i % 10 == 0 or i == len(steps))
        if row is not None:
            rows.append(row)
    return rows, state


def test_a_row_holds_the_token_weighted_mean_of_the_steps_since_the_last_row() -> None:
    steps = _steps(25)
    rows, state = _rows(steps, TrainState())
    assert [r["sft/loss_steps"] for r in rows] == [10, 10, 5]
    for row, window in zip(rows, (steps[0:10], steps[10:20], steps[20:25]), strict=True):
        want = (sum(m["sft/loss"] * m["sft/tokens"] for m in window)
                / sum(m["sft/tokens"] for m in window))
        assert row["sft/loss"] == pytest.approx(want, rel=1e-12)
        assert row["sft/step_loss"] == window[-1]["sft/loss"]  # the row's own step
        assert row["sft/grad_norm"] == window[-1]["sft/grad_norm"]
    assert state.sft_loss_window == []


@pytest.mark.parametrize("stop_at", [10, 14])
def test_a_run_resumed_between_rows_writes_the_rows_of_an_unstopped_run(stop_at: int) -> None:
    steps = _steps(25)
    want, _ = _rows(steps, TrainState())
    before, state = _rows(steps, TrainState(), stop_at=stop_at)
    saved = msgspec.json.decode(msgspec.json.encode(state), type=TrainState)  # a checkpoint
    after, _ = _rows(steps, saved, first=stop_at + 1)
    assert before + after == want
