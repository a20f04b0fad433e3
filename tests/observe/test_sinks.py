"""Metric sinks: the naming rule, TensorBoard event files read back with TensorBoard's own
reader, a W&B offline run's transaction log read back, and a failing sink that cannot cost
the JSONL file a row."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl import config
from asyncrl.config import LoggingSection
from asyncrl.errors import ConfigError
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.observe.sinks import open_sinks, scalars

ROWS: list[dict[str, Any]] = [
    {"kind": "data", "step": 0, "train": 64, "eval": 8, "overlong_skipped": 0},
    {"kind": "sft_step", "stage": "sft", "step": 0, "sft_step": 10, "sft/loss": 2.5},
    {"kind": "sft_step", "stage": "sft", "step": 0, "sft_step": 20, "sft/loss": 1.5},
    {"kind": "rl_step", "stage": "rl", "step": 1, "policy_version": 2, "reward/mean": 0.25,
     "problem_ids": ["a", "b"], "timing/step_s": 3.0, "bad": math.nan, "flag": True},
    {"kind": "rl_step", "stage": "rl", "step": 2, "policy_version": 3, "reward/mean": 0.5,
     "problem_ids": ["c", "d"], "timing/step_s": 2.0},
    {"kind": "eval", "label": "final", "stage": "rl", "step": 2, "seconds": 4.0,
     "eval/accuracy": 0.75},
]


def _write_all(run_dir: Path, sinks: list[Any]) -> list[dict[str, Any]]:
    with MetricsWriter(run_dir, sinks=sinks) as w:
        return [w.write(r["kind"], **{k: v for k, v in r.items() if k != "kind"}) for r in ROWS]


def _expected(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        step, vals = scalars(r)
        for k, v in vals.items():
            out.setdefault(k, []).append((step, v))
    return out


def test_naming_rule_keeps_namespaced_keys_and_prefixes_bare_ones() -> None:
    step, vals = scalars(ROWS[3])
    assert step == 1
    assert vals == {"rl_step/policy_version": 2.0, "reward/mean": 0.25, "timing/step_s": 3.0}
    assert scalars(ROWS[1]) == (10, {"sft/loss": 2.5})  # SFT rows: x is sft_step
    assert scalars(ROWS[5])[1] == {"eval/seconds": 4.0, "eval/accuracy": 0.75}


def test_tensorboard_reader_finds_every_scalar(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing import event_accumulator as ea

    sinks = open_sinks(LoggingSection(sinks=["tensorboard"]), tmp_path, {})
    rows = _write_all(tmp_path, sinks)
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got.keys() == _expected(rows).keys()
    for tag, points in _expected(rows).items():  # stored as float32
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    assert got["sft/loss"] == [(10, 2.5), (20, 1.5)]


def test_wandb_offline_run_holds_every_scalar(tmp_path: Path, wandb_records: Any) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    sinks = open_sinks(LoggingSection(sinks=["wandb"]), tmp_path,
                       {"run": {"name": "t", "seed": 3}})
    rows = _write_all(tmp_path, sinks)
    recs = wandb_records(tmp_path)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in r.history.item} for r in recs if r.WhichOneof("record_type") == "history"]
    got: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        x = h.get("sft_step", h.get("step"))
        for k, v in h.items():
            if not k.startswith("_") and k not in ("step", "sft_step"):
                got.setdefault(k, []).append((x, v))
    assert got == _expected(rows)
    configs = [r.run.config for r in recs if r.WhichOneof("record_type") == "run"]
    assert any(u.key == "run" and json.loads(u.value_json)["seed"] == 3
               for c in configs for u in c.update)
    assert not list(tmp_path.glob("wandb/run-*"))  # offline: nothing was synced


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    def write(self, row: Any) -> None:
        self.calls += 1
        raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_switched_off_and_the_jsonl_keeps_every_row(tmp_path: Path) -> None:
    broken = _Broken()
    rows = _write_all(tmp_path, [broken])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) == len(ROWS)
    assert broken.calls == 1  # dropped after its first failure


def test_missing_package_names_the_key_and_the_extra(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match=r"logging\.sinks.*asyncrl\[tensorboard\]"):
        open_sinks(LoggingSection(sinks=["tensorboard"]), tmp_path, {})


def test_config_rejects_unknown_and_repeated_sinks() -> None:
    base = {"model": {"init": {"model_type": "qwen3"}}, "data": {"train": "x.jsonl"},
            "stages": [{"name": "rl", "steps": 1}]}
    with pytest.raises(ConfigError, match=r"logging\.sinks"):
        config.from_dict({**base, "logging": {"sinks": ["mlflow"]}})
    with pytest.raises(ConfigError, match=r"logging\.sinks"):
        config.from_dict({**base, "logging": {"sinks": ["wandb", "wandb"]}})
    cfg = config.from_dict({**base, "logging": {"sinks": ["tensorboard"], "rollouts_every": 0}})
    assert cfg.logging.sinks == ["tensorboard"] and cfg.logging.wandb_mode == "offline"


def test_a_sink_that_cannot_start_is_a_config_error(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    (tmp_path / "tensorboard").write_text("a file where the sink's directory goes")
    with pytest.raises(ConfigError, match=r"logging\.sinks: the tensorboard sink could not start"):
        open_sinks(LoggingSection(sinks=["tensorboard"]), tmp_path, {})
