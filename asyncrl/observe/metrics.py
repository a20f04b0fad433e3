"""Run metrics: per-step statistics of rollouts and the JSON-lines writer.

Owns: how a list of finished groups becomes the numbers a person watches (reward, accuracy,
response length, tool calls, tool-error ratio of all and of positive rollouts, timing), and the
`metrics.jsonl` file in the run directory (one JSON object per line, read by `asyncrl report`).
Does not own: what is logged when (the train loop decides).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import fmean
from typing import IO, TYPE_CHECKING, Any

import orjson

from asyncrl.log import get_logger
from asyncrl.records import Group, Rollout, RolloutStatus

if TYPE_CHECKING:
    from asyncrl.observe.sinks import MetricSink

log = get_logger(__name__)


def _mean(xs: list[float]) -> float:
    return fmean(xs) if xs else 0.0


def rollout_stats(rollouts: Iterable[Rollout], prefix: str = "rollout") -> dict[str, float]:
    """Summary statistics of a set of finished, rewarded rollouts."""
    rs = list(rollouts)
    if not rs:
        return {f"{prefix}/count": 0.0}
    with_calls = [r for r in rs if r.tool_calls]
    pos_with_calls = [r for r in with_calls if r.is_correct]
    calls = sum(len(r.tool_calls) for r in rs)
    failed = sum(sum(c.failed for c in r.tool_calls) for r in rs)
    pos_calls = sum(len(r.tool_calls) for r in pos_with_calls)
    pos_failed = sum(sum(c.failed for c in r.tool_calls) for r in pos_with_calls)
    return {
        f"{prefix}/count": float(len(rs)),
        f"{prefix}/reward_mean": _mean([r.reward for r in rs]),
        f"{prefix}/response_tokens_mean": _mean([float(len(r.response_ids)) for r in rs]),
        f"{prefix}/tool_calls_mean": calls / len(rs),
        f"{prefix}/tool_use_frac": len(with_calls) / len(rs),
        # call-level ratios: failed calls / calls, over all rollouts and over positive ones
        f"{prefix}/tool_error_ratio": failed / calls if calls else 0.0,
        f"{prefix}/tool_error_ratio_pos": pos_failed / pos_calls if pos_calls else 0.0,
        # the counts behind it, so a run's ratio can weigh steps by their calls
        f"{prefix}/tool_calls_pos": float(pos_calls),
        f"{prefix}/tool_errors_pos": float(pos_failed),
        f"{prefix}/truncated_frac": _mean(
            [float(r.status == RolloutStatus.TRUNCATED) for r in rs]),
        f"{prefix}/failed_frac": _mean([float(r.status == RolloutStatus.FAILED) for r in rs]),
        f"{prefix}/no_answer_frac": _mean([float(r.answer is None) for r in rs]),
        f"{prefix}/reward_timeout_count": float(
            sum(r.reward_status == "reward_timeout" for r in rs)),
        # the reward check raised or its host failed twice (`asyncrl.tasks.rewards.math.MathReward`);
        # a text environment's fault at reward time is an env error, below, not this
        f"{prefix}/reward_error_count": float(
            sum(r.reward_status == "reward_error" and not _env_fault(r) for r in rs)),
        # a part of the reward raised and scored 0 while the others counted (a verifiers
        # reward function, a rubric function: `Rollout.reward_errors`)
        f"{prefix}/reward_part_error_count": float(
            sum(bool(r.reward_errors) and r.reward_status != "reward_error" for r in rs)),
        # a text environment raised or broke its contract, during a turn (the rollout failed)
        # or in the step its reward ran (`asyncrl.tasks.bridges.textenv`): counted once, here
        f"{prefix}/env_error_count": float(sum(_env_fault(r) for r in rs)),
        f"{prefix}/failed_count": float(sum(r.status == RolloutStatus.FAILED for r in rs)),
        f"{prefix}/tool_wait_s_mean": _mean([r.timing.tool_wait_s for r in rs]),
        f"{prefix}/generation_s_mean": _mean([r.timing.generation_s for r in rs]),
        **_reward_parts(rs, prefix),
    }


def _env_fault(r: Rollout) -> bool:
    if r.status == RolloutStatus.FAILED:
        return r.error.startswith("environment:")
    return r.reward_status == "reward_error" and bool(r.reward_errors) and \
        r.reward_errors[0].startswith("environment:")


def _reward_parts(rs: list[Rollout], prefix: str) -> dict[str, float]:
    """The mean of each named reward part (`Rollout.reward_detail`: a verifiers task's
    rewards and metrics, a text environment's steps) over the rollouts that have it."""
    parts: dict[str, list[float]] = {}
    for r in rs:
        for name, value in r.reward_detail.items():
            parts.setdefault(name, []).append(value)
    return {f"{prefix}/reward_part/{name}": _mean(v) for name, v in sorted(parts.items())}


def numeric(m: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric (non-bool) values of a trainer's metrics dict as floats, each key under
    `prefix` unless it already starts with it."""
    return {(k if not prefix or k.startswith(prefix) else prefix + k): float(v)
            for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def group_rollouts(groups: Iterable[Group]) -> list[Rollout]:
    return [r for g in groups for r in g.rollouts]


class MetricsWriter:
    """Appends one JSON object per line to `run_dir/metrics.jsonl`; stamps time since start.

    Each row then goes to every sink in `sinks` (`asyncrl.observe.sinks`: TensorBoard, W&B). A sink
    that raises is logged once and dropped: the JSONL file, the record the report reads, never
    loses a row because of a sink. `close` closes the sinks too.
    """

    def __init__(self, run_dir: Path, start_time: float | None = None,
                 sinks: Sequence[MetricSink] = ()) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fp: IO[bytes] = self.path.open("ab")
        self._fp.seek(0, 2)
        self.rows = self._count_rows()
        """Rows in the file so far (a resumed run's included)."""
        self._t0 = time.monotonic() if start_time is None else start_time
        self.sinks = list(sinks)

    def _count_rows(self) -> int:
        with self.path.open("rb") as f:
            data = f.read()
        if data and not data.endswith(b"\n"):  # a line cut short by a crash: end it
            self._fp.write(b"\n")
            self._fp.flush()
            data += b"\n"
        return data.count(b"\n")

    def write(self, kind: str, **values: Any) -> dict[str, Any]:
        row = {"kind": kind, "time_s": round(time.monotonic() - self._t0, 3), **values}
        self._fp.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._fp.flush()
        self.rows += 1
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as e:  # any sink failure: the run and the JSONL file go on
                log.warning("metric_sink_failed", sink=sink.name, error=repr(e),
                            hint="this sink is off for the rest of the run")
                self.sinks.remove(sink)
        return row

    def close(self) -> None:
        self._fp.close()
        from asyncrl.observe.sinks import close_sinks

        close_sinks(self.sinks)
        self.sinks = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
