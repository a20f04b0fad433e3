"""Engine-test fixtures: tiny models whose greedy output depends on the context.

The shared tiny model is initialised with std 0.02, so greedy decoding just repeats a token and
a broken cache or position would go unnoticed. Re-drawing the matrices with std 0.2 gives
varied, context-dependent continuations, which makes "equals `model.generate`" a real check.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def spiky_model_factory(tiny_model_factory):
    def make(seed: int = 0):
        m = tiny_model_factory(seed)
        g = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.2, generator=g)
        return m.eval()

    return make
