"""Run megatron-core 0.16 on a CPU-only torch over gloo: tests, and runs on CPU-only machines.

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

3. CUDA-only optimizer path. megatron's DDP wrapper, its optimizers (plain and distributed)
   and its grad clipping create tensors with `device="cuda"` and accept only parameters whose
   `Tensor.type()` is a `torch.cuda.*Tensor`. `cuda_as_cpu()` (a torch function mode, entered
   only by the tests that run that path on CPU) sends those tensors to the CPU and names CPU
   tensor types as their CUDA twins; everything else runs unchanged. The Megatron trainer
   itself uses plain torch AdamW with explicit collectives when it runs on CPU.
4. MoE's token dispatcher: the all-to-all one makes CUDA streams at construction; the model
   builder picks the all-gather dispatcher on a CPU. (The router's missing `te_general_gemm`
   without Transformer Engine is on every device: `model.build_gpt` defines it.)
Megatron's own `DotProductAttention` (only built on request: `attention="local"`) gets an
explicit causal mask from `model.causal_mask`, since its default one is built on "cuda"; the
fused cores need none.

Tests (and the torchrun test worker) enter `cpu_megatron()` around everything that builds or
runs a Megatron model. A real run on a CPU-only torch (`asyncrl train` with `trainer.kind =
"megatron"`, one process or many over gloo) gets points 1 and 2 for the rest of the process
from `model.init_parallel`, through `install_for_process()`; point 3 is never needed there,
since the trainer then uses torch AdamW. Both refuse to patch a torch that has CUDA, so
neither can silently change behaviour on a GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


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

    CpuRNGStatesTracker.asyncrl_cpu = True  # type: ignore[attr-defined]
    return CpuRNGStatesTracker


def installed() -> bool:
    """Whether megatron-core is patched for the CPU right now (by either entry point)."""
    from megatron.core.tensor_parallel import random as mrandom

    return bool(getattr(mrandom.CudaRNGStatesTracker, "asyncrl_cpu", False))


_PROCESS_PATCH: contextlib.ExitStack | None = None


def install_for_process() -> None:
    """Patch megatron-core for the CPU until the process ends (idempotent; a no-op while a
    test's `cpu_megatron()` block is active)."""
    global _PROCESS_PATCH
    if installed():
        return
    stack = contextlib.ExitStack()
    stack.enter_context(cpu_megatron())
    _PROCESS_PATCH = stack  # kept, never closed: the patch lasts as long as the process


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


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # a CUDA ordinal
        return "cpu"
    return device


class _CudaAsCpu(TorchFunctionMode):
    """CUDA placements become CPU ones; `Tensor.type()` answers with the CUDA type name."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a
                         for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.",
                                                                            1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Run megatron's CUDA-only DDP and optimizers on CPU tensors while the block runs (inside
    `cpu_megatron()`): see point 3 of the module docstring. For tests only."""
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat is for CPU-only torch builds; this torch has CUDA")
    with _CudaAsCpu():
        yield
