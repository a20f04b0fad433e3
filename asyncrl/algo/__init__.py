"""GRPO-RoC, the algorithm, separated from any trainer so every trainer shares one copy.

Modules:
- `roc`: per-rollout penalties and Resample-on-Correct selection (2G -> G), pure Python.
- `advantages`: group-normalised advantages on the kept set, pure Python.
- `batching`: a `records.Batch` flattened into training sequences, mini-batches, rank shards
  and token-budget micro-batch packing, pure Python.
- `schedule`: the learning-rate schedule (warmup, constant or cosine), pure Python.
- `loss`: token logprobs, the clipped-ratio policy loss with dual-clip, the masked SFT loss and
  the metric accumulator. The only module here that imports torch (it is trainer-side code).

Nothing here owns a model, an optimizer or a process group; trainers do.
"""
