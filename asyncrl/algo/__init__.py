"""GRPO-RoC, the algorithm, separated from any trainer so every trainer shares one copy.

Modules:
- `roc`: per-rollout penalties and Resample-on-Correct selection (2G -> G), pure Python.
- `advantages`: group-normalised advantages on the kept set, pure Python.
- `batching`: a `records.Batch` flattened into training sequences, mini-batches, rank shards
  and token-budget micro-batch packing, pure Python.
- `schedule`: the learning-rate schedule (warmup, constant or cosine), pure Python.
- `loss`: token logprobs, the clipped-ratio policy loss with dual-clip, the masked SFT loss and
  the metric accumulator.
- `offpolicy`: the behaviour-policy corrections and the trainer/sampler mismatch metrics.
- `step`: the RL and SFT steps, written once over the `StepBackend` each trainer implements.
  `loss`, `offpolicy` and `step` import torch (trainer-side code); the rest is pure Python.

Nothing here owns a model, an optimizer or a process group; trainers do.
"""
