"""Runs whose rollouts call the Python tool repeat: two runs of the micro curriculum with the
same seed and seeded requests (`rollout.seed_requests`) give the same metrics, timing keys
aside, and the same rollouts token for token. The tool outputs show no measured time
(`rollout.tool_time = "auto"` resolves to `none` for a seeded run), which would differ from
run to run and change what the model reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from micro_config import (
    MICRO_DATA,
    MICRO_ENGINE,
    MICRO_MODEL,
    metric_rows,
    micro_rollout,
    run_all_ok,
    saved_rollouts,
)


def config(tool_time: str | None = None) -> str:
    """The micro curriculum: a cold start that always calls the tool, then two RL steps."""
    return CONFIG_HEAD + micro_rollout(
        roc={"reject_equal_reward": False}, max_response_tokens=96, seed_requests=True,
        tool_time=tool_time) + CONFIG_TAIL


CONFIG_HEAD = """
[run]
name = "repeat"
seed = 3
""" + MICRO_MODEL + MICRO_DATA
CONFIG_TAIL = """[algorithm]
lr = 1e-3
""" + MICRO_ENGINE + """[[stages]]
name = "sft"
kind = "sft"
steps = 200
batch_size = 4
lr = 3e-3
tool_fraction = 1.0
fail_fix_fraction = 0.0
[[stages]]
name = "rl"
steps = 2
[eval]
every_steps = 2
max_problems = 2
[checkpoint]
every_steps = 0
[logging]
console = "json"
rollouts_every = 1
"""

TIMING = ("timing/", "time", "wall", "seconds", "_s_", "_s", "per_s", "async/")
"""Keys measured from the clock (`..._s`, throughput, timings): the only ones that differ."""


def comparable(row: dict) -> dict:
    """The row without its timing keys, numbers rounded at 1e-6: the sampler/trainer mismatch
    figures (`train/mismatch_*`, ~1e-7) vary in their last bits with the local engine's batch
    composition, which is timing too; tokens, rewards, losses and counts are equal exactly."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()
            if k not in ("t", "ts") and not any(m in k for m in TIMING)}


def command(tmp: Path, name: str, tool_time: str | None = None) -> tuple[list[str], Path]:
    """The `asyncrl train` command of a run named `name` under `tmp`, and its run directory."""
    cfg = tmp / f"{name}.toml"
    cfg.write_text(config(tool_time))
    run_dir = tmp / name
    return [sys.executable, "-m", "asyncrl.cli.main", "train", str(cfg), "--run-dir",
            str(run_dir)], run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three runs started together (a minute on two cores, more when busy): `a` and `b` with
    the default tool time, `measured` with `rollout.tool_time = "measured"`."""
    tmp = tmp_path_factory.mktemp("repeat")
    made = {name: command(tmp, name, tool_time)
            for name, tool_time in (("a", None), ("b", None), ("measured", "measured"))}
    run_all_ok([cmd for cmd, _ in made.values()])
    return {name: run_dir for name, (_, run_dir) in made.items()}


@pytest.mark.timeout(900)
def test_two_seeded_runs_with_tool_calls_give_the_same_metrics(runs):
    a, b = runs["a"], runs["b"]
    rl = metric_rows(a, "rl_step")
    assert rl and all(r["rollout/tool_calls_mean"] > 0 for r in rl)  # the tool was called
    for kind in ("sft_step", "rl_step", "eval"):
        ra, rb = metric_rows(a, kind), metric_rows(b, kind)
        assert ra and [comparable(r) for r in ra] == [comparable(r) for r in rb], kind
        for x, y in zip(ra, rb, strict=True):
            assert x.get("train/loss") == y.get("train/loss"), kind  # bit for bit
    ta, tb = saved_rollouts(a), saved_rollouts(b)
    assert ta and [r["response_ids"] for r in ta] == [r["response_ids"] for r in tb]
    read = [r for r in ta if "Execution" in r["response_text"]]  # outputs the model read
    assert read and not any("Time: " in r["response_text"] for r in ta)


@pytest.mark.timeout(900)
def test_a_measured_time_is_shown_when_asked(runs):
    assert any("Time: " in r["response_text"] for r in saved_rollouts(runs["measured"]))
