"""Fixtures for the Megatron tests: megatron-core on the CPU, one process (world of one).

Tests that need megatron-core skip with a reason when it is not installed; the conversion
tests (`test_convert.py`) need only torch.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def cpu_megatron():
    """megatron-core patched for the CPU (`cpu_compat`) for the test; parallel state and the
    process group are torn down afterwards so later tests start clean."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                                                "(pip install megatron-core==0.16.0)")
    import torch
    import torch.distributed as dist

    from asyncrl.trainer.megatron.cpu_compat import cpu_megatron as patched

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with patched():
        try:
            yield
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(threads)
