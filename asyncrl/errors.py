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
    └── CheckpointError              a checkpoint cannot be written or read

Sandbox failures are `sandbox.errors.SandboxError` (the sandbox is its own package).
Third-party exceptions are translated at the edge into one of these.
"""

from __future__ import annotations


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
