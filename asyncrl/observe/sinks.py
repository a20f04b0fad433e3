"""Metric sinks: where a run's metric rows go besides `metrics.jsonl`.

Owns: the `MetricSink` interface, the TensorBoard and Weights & Biases sinks, the registry
that `logging.sinks` picks from, and the one rule that turns a metric row into named scalars
(`scalars`), so every sink shows the same names as `metrics.jsonl`. Does not own: the JSONL
file (`asyncrl.observe.metrics.MetricsWriter`, always written, the source of `asyncrl report`) or what
the train loop logs.

Naming rule (`scalars`): every finite number of a row becomes one scalar. A key that already
has a namespace (`reward/mean`, `eval/accuracy`, `timing/step_s`) keeps its name; a bare key
gets the row's kind as namespace (`policy_version` of an `rl_step` row -> `rl_step/policy_version`,
`seconds` of an `eval` row -> `eval/seconds`). The row's x value is its `step` (the global RL
step), except for `sft_step` rows, whose x is `sft_step` (their `step` stays 0 during SFT).
`kind`, `step`, `sft_step` and `time_s` are bookkeeping, not scalars; strings, lists and
booleans are skipped.

A sink that fails while the run is going (disk full, a W&B service crash) is logged once and
switched off; the run and the JSONL file go on. A sink whose package is missing, or that
cannot start, is a `ConfigError` at start naming `logging.sinks` (and the extra to install).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import LoggingSection
from asyncrl.errors import ConfigError
from asyncrl.log import get_logger

log = get_logger(__name__)

BOOKKEEPING = frozenset({"kind", "step", "sft_step", "time_s"})
"""Row keys that place a row (x axis, type) rather than measure something."""


def scalars(row: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
    """`(x, {name: value})` of one metric row, by the module's naming rule."""
    kind = str(row.get("kind", "row"))
    x_key = "sft_step" if kind == "sft_step" else "step"
    x = row.get(x_key, 0)
    step = int(x) if isinstance(x, int | float) and not isinstance(x, bool) else 0
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in BOOKKEEPING or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if not math.isfinite(v):
            continue
        out[k if "/" in k else f"{kind}/{k}"] = float(v)
    return step, out


class MetricSink(Protocol):
    """Receives every metric row the run writes, in order, after `metrics.jsonl` has it."""

    name: str

    def write(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into `RUN_DIR/tensorboard/` (event files; `tensorboard --logdir RUN_DIR`).

    One event per row holding all its scalars (TensorBoard's scalar summaries, the format
    `torch.utils.tensorboard` writes), through TensorBoard's own `EventFileWriter`, whose
    thread writes the file and flushes it every `FLUSH_S` seconds and at close. One event per
    row rather than one `add_scalar` per key keeps a row at a fraction of a millisecond on the
    event loop (`bench/metric_sinks.py`).
    """

    name = "tensorboard"
    FLUSH_S = 10

    def __init__(self, run_dir: Path, cfg: LoggingSection, config: Mapping[str, Any]) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ConfigError("logging.sinks", "the tensorboard sink needs the tensorboard "
                              "package: pip install 'asyncrl[tensorboard]'") from None
        self._event, self._summary = Event, Summary
        self.dir = run_dir / "tensorboard"
        self._writer = EventFileWriter(str(self.dir), max_queue_size=1024,
                                       flush_secs=self.FLUSH_S)

    def write(self, row: Mapping[str, Any]) -> None:
        step, values = scalars(row)
        if not values:
            return
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=v)
                                       for tag, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in `RUN_DIR/wandb/` (`logging.wandb_mode`, offline by default:
    no network, no account; `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later).

    The resolved config is the run's config. W&B's own step counts rows; each row also logs its
    x value (`step`, or `sft_step` for SFT rows), and `define_metric` makes that the x axis of
    its namespace, so charts read like TensorBoard's.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, cfg: LoggingSection, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.sinks", "the wandb sink needs the wandb package: "
                              "pip install 'asyncrl[wandb]'") from None
        self._run = wandb.init(
            mode=cfg.wandb_mode, dir=str(run_dir), project=cfg.wandb_project,
            entity=cfg.wandb_entity or None, name=run_dir.name, config=dict(config),
            settings=wandb.Settings(console="off", silent=True))
        self._namespaces: set[str] = set()

    def write(self, row: Mapping[str, Any]) -> None:
        step, values = scalars(row)
        if not values:
            return
        x_key = "sft_step" if row.get("kind") == "sft_step" else "step"
        for ns in {k.split("/", 1)[0] for k in values} - self._namespaces:
            self._run.define_metric(f"{ns}/*", step_metric=x_key)
            self._namespaces.add(ns)
        self._run.log({**values, x_key: step})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # `finish` can return before the wandb-core service has written the run's last
        # records to disk (about half the time under load here, wandb 0.31, offline): shutting
        # the service down waits for it. One sink per process: nothing else uses the service.
        wandb.teardown()


SinkFactory = Callable[[Path, LoggingSection, Mapping[str, Any]], MetricSink]
SINK_KINDS: dict[str, SinkFactory] = {"tensorboard": TensorBoardSink, "wandb": WandbSink}
"""`logging.sinks` entry -> sink class (`cls(run_dir, logging_section, resolved_config)`)."""


def open_sinks(cfg: LoggingSection, run_dir: Path, config: Mapping[str, Any]) -> list[MetricSink]:
    """The sinks `cfg.sinks` names, opened; on a failure the ones already open are closed."""
    sinks: list[MetricSink] = []
    try:
        for kind in cfg.sinks:
            try:
                sinks.append(SINK_KINDS[kind](run_dir, cfg, config))
            except ConfigError:
                raise
            except Exception as e:  # the package's own failure (service, disk): name the sink
                raise ConfigError("logging.sinks", f"the {kind} sink could not start: "
                                                   f"{e!r}") from e
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: list[MetricSink]) -> None:
    for s in sinks:
        try:
            s.close()
        except Exception as e:  # closing one sink must not stop the others from closing
            log.warning("metric_sink_close_failed", sink=s.name, error=repr(e))
