"""Fixtures the CPU kernel tests share: the thread count and the CPU backend."""

import pytest
import torch

import commpress.cuda as cc
from commpress.cuda import _backend


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test on one thread and on two (torch's pool, which the CPU kernels use)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def both(monkeypatch):
    """``both(fn)``: fn's result under the numba backend and under the numpy backend."""

    def run(fn):
        results = []
        for name in ("numba", "numpy"):
            monkeypatch.setenv(_backend.ENV, name)
            _backend.reset()
            assert cc.cpu_backend() == name
            results.append(fn())
        return results

    yield run
    _backend.reset()  # the environment is restored after this fixture; the next call reads it again
