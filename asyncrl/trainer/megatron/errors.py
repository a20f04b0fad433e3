"""Errors of the Megatron trainer; all are `asyncrl.errors.TrainerError`.

    TrainerError (asyncrl.errors)
    └── MegatronError                 base of the Megatron trainer's errors
        ├── UnsupportedModelError     the HF config asks for something this backend cannot
        │                             build, or cannot split as configured (names the field)
        ├── ConversionError           a state dict does not match the architecture (missing,
        │                             unexpected or mis-shaped tensor)
        └── MegatronUnavailableError  megatron-core is not importable (the `gpu` extra)
"""

from __future__ import annotations

from asyncrl.errors import TrainerError


class MegatronError(TrainerError):
    """Base of the Megatron trainer's errors."""


class UnsupportedModelError(MegatronError):
    """A HF config field this backend cannot represent; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConversionError(MegatronError):
    """A state dict that does not fit the architecture it is converted for."""


class MegatronUnavailableError(MegatronError):
    """megatron-core could not be imported."""
