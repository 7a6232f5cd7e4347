"""Reference-engine tests run single-threaded: these tensors are tiny, and two intra-op threads on
a shared 2-core machine spend far more time in OpenMP barriers than in math (measured ~100x)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
