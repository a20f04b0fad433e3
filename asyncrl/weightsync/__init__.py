"""Weights from the trainer to the engines: the wing above `engine/` and `trainer/`.

`push.push_weights` is the train loop's push (disk, tensor or distributed, LoRA adapters);
`group.WeightGroup` is trainer rank 0's process group with SGLang servers for the distributed
mode. Weights flow one way, trainer -> weightsync -> engine: neither `engine/` nor `trainer/`
imports this package, and `engine/` never imports `trainer/` (`tests/test_import_graph.py`).
"""

from __future__ import annotations

from asyncrl.weightsync.group import WeightGroup
from asyncrl.weightsync.push import push_weights

__all__ = ["WeightGroup", "push_weights"]
