"""Fixtures the CPU kernel tests share: the thread count and the oracle."""

import kernel_oracle
import pytest
import torch

import commpress.kernels as cc


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test on one thread and on two (torch's pool, which the CPU kernels use)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def both():
    """``both(fn)``: ``[fn(commpress.kernels), fn(kernel_oracle)]``, the kernels' result and the oracle's."""
    return lambda fn: [fn(cc), fn(kernel_oracle)]
