"""Trainers: the registry of trainer kinds (`trainer.kind` in the config).

`TRAINER_KINDS[kind](model, trainer_cfg, algorithm_cfg, pad_token_id=..., **options)` builds a
trainer implementing `asyncrl.trainer.base.Trainer`. The values are small factories that import
their module when called, so importing `asyncrl.trainer` loads neither torch nor megatron-core
(add a kind the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Trainer


def _torch(*args: Any, **kwargs: Any) -> Trainer:
    from .torch_trainer import TorchTrainer

    return TorchTrainer(*args, **kwargs)


def _megatron(*args: Any, **kwargs: Any) -> Trainer:
    from .megatron.launch import make_trainer

    return make_trainer(*args, **kwargs)


TRAINER_KINDS: dict[str, Callable[..., Trainer]] = {"torch": _torch, "megatron": _megatron}

__all__ = ["TRAINER_KINDS", "Trainer"]
