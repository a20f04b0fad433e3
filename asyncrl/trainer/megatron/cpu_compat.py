"""Run megatron-core 0.16 on a CPU-only torch over gloo — for tests only.

megatron-core is written for CUDA. On a CPU build of torch two of its assumptions break the
model we use (`GPTModel`, local layer spec, tensor parallel over gloo):

1. RNG tracker. `model_parallel_cuda_manual_seed` and every `get_cuda_rng_tracker().fork()`
   (attention dropout, weight init) read and write `torch.cuda` generator states. We swap in
   a tracker with the same interface that keeps *CPU* generator states, and make the CUDA
   default generator's get/set (activation recompute's `tensor_parallel.checkpoint` saves and
   restores it around the recomputed forward) an empty state and a no-op: the CPU state,
   which that function also saves and restores, is the only one there is.
2. CUDA device for buffers. The global memory buffer that attention scores are written into,
   and RoPE's `inv_freq`, are placed on `torch.cuda.current_device()`. We make that function
   answer "cpu" — only on a torch without CUDA, where it could otherwise only raise.

Not covered, and not used on CPU by the trainer: megatron's DDP wrapper, its optimizers
(plain and distributed) and its grad clipping, which hard-code `device="cuda"` in many places;
the Megatron trainer uses plain torch AdamW with explicit collectives when it runs on CPU.
Megatron's own `DotProductAttention` (only built on request: `attention="local"`) gets an
explicit causal mask from `model.causal_mask`, since its default one is built on "cuda"; the
fused cores need none.

Production code never imports this module; tests (and the torchrun test worker) enter
`cpu_megatron()` around everything that builds or runs a Megatron model. It refuses to patch
a torch that has CUDA, so it cannot silently change behaviour on a GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` whose named states are CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Patch megatron-core for CPU while the block runs; restore everything on exit."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat is for CPU-only torch builds; this torch has CUDA")
    from megatron.core.tensor_parallel import random as mrandom

    saved_device = torch.cuda.current_device
    saved_class = mrandom.CudaRNGStatesTracker
    saved_get, saved_set = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom.CudaRNGStatesTracker = _cpu_tracker_class()
    mrandom.initialize_rng_tracker(force_reset=True)  # a fresh tracker of the CPU class
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device  # type: ignore[method-assign]
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_get, saved_set
        mrandom.CudaRNGStatesTracker = saved_class
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
