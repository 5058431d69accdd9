"""Fixtures shared by the LightTEA unit tests."""

from __future__ import annotations

import pytest
import torch

from tea_pipeline import TKGPair, make_synthetic_pair


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: the CI machine is shared, and OpenMP spin-waits on oversubscribed cores
    make small kernels erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_pair() -> TKGPair:
    return make_synthetic_pair(num_entities=300, num_times=25, seed=3)
