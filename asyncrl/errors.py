"""Exceptions raised by asyncrl. Each name says which boundary failed.

    AsyncRLError                     base of everything asyncrl raises on purpose
    ├── ConfigError                  a config key is unknown, mistyped or impossible (names the key)
    ├── DataError                    a data source cannot be read; bad rows are counted, not raised
    ├── ModelError                   a path is not a model (or run) directory asyncrl can load
    ├── BudgetError                  a rollout's token budget cannot fit an engine's KV capacity
    ├── EngineError                  an inference engine failed a request
    │   ├── EngineUnavailable        the engine is down or stopped answering (its rollouts requeue)
    │   └── EngineOverloaded         the engine refused a request for capacity (retry later)
    ├── ToolCallError                a tool call could not be parsed or dispatched (answered to the
    │                                model as an error message; never kills a rollout)
    ├── RewardError                  the reward function failed (the rollout scores 0, recorded)
    ├── TrainerError                 the trainer failed an update or a weight export
    ├── WeightSyncError              new weights could not reach an engine
    ├── CheckpointError              a checkpoint cannot be written or read
    └── RunStopped                   a stop was asked for (SIGINT / SIGTERM); not a failure: the
        │                            run saved its last completed step (`asyncrl.stopping`)
        └── StepAbandoned            a trainer gave up the step it was taking for a stop (its
                                     weights and optimizer untouched)

Sandbox failures are `sandbox.errors.SandboxError` (the sandbox is its own package).
Third-party exceptions are translated at the edge into one of these.
"""

from __future__ import annotations

from typing import Any


class AsyncRLError(Exception):
    """Base of every exception asyncrl raises on purpose."""


class ConfigError(AsyncRLError):
    """A config value is unknown, mistyped or impossible. `key` is the dotted path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class DataError(AsyncRLError):
    """A data source cannot be read at all."""


class ModelError(AsyncRLError):
    """A path is not a model directory (or run directory) that can be loaded; names the path."""


class BudgetError(AsyncRLError):
    """A rollout's tokens (prompt + response budget) can never fit an engine's KV capacity;
    names both numbers. Raised before anything runs."""


class EngineError(AsyncRLError):
    """An inference engine failed a request."""


class EngineUnavailable(EngineError):
    """The engine is down or stopped answering; its rollouts go back to the queue."""


class EngineOverloaded(EngineError):
    """The engine refused a request for lack of capacity."""


class ToolCallError(AsyncRLError):
    """A tool call could not be parsed or dispatched; answered to the model as tool output."""


class RewardError(AsyncRLError):
    """The reward function failed on a rollout."""


class TrainerError(AsyncRLError):
    """The trainer failed an update or an export."""


class WeightSyncError(AsyncRLError):
    """New weights could not reach an engine."""


class CheckpointError(AsyncRLError):
    """A checkpoint cannot be written or read."""


class RunStopped(AsyncRLError):
    """The run stopped on request (`signal_name`: SIGINT, SIGTERM). Raised inside the loop where
    the stop is noticed; by the time it leaves `train_async` the last completed step is saved:
    `checkpoint` is the newest complete checkpoint (None: nothing was completed yet) and
    `run_dir` the run's directory."""

    def __init__(self, signal_name: str = "") -> None:
        super().__init__(f"stopped by {signal_name or 'request'}")
        self.signal_name = signal_name
        self.checkpoint: Any = None
        self.run_dir: Any = None
        self.saved_now = False
        """Whether the stop itself wrote `checkpoint` (else it was there already)."""
        self.where = ""
        """The last completed step, in words (stage and step)."""


class StepAbandoned(RunStopped):
    """A trainer gave up the step it was running because a stop was requested
    (`StopRequest.overdue`): raised between micro-batches, before any optimizer step of the
    call, with the gradients dropped; the weights and optimizer state are those of the last
    completed step, which the loop then saves."""
