"""Fixtures the CPU kernel tests share (the thread count and the oracle), and the order in
which the files run."""

import faulthandler

import kernel_oracle
import pytest
import torch

import commpress.kernels as cc

#: Test files that take a minute or more on a 2-core machine, slowest first. `scripts/test`
#: runs each file on one of two pytest-xdist workers, handing files out in collection order
#: (`--no-loadscope-reorder`; xdist's default orders them by their number of tests, which put
#: these, with few tests each, last, and the slowest ran alone for the suite's last minutes).
SLOWEST_FILES = ("test_readme_demo.py", "test_gpu_check.py", "test_ft_race.py", "test_old_torch.py", "test_fsdp_train.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect SLOWEST_FILES first (the sort is stable: every file keeps its own order)."""
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


#: the longest a test process may take to exit once its tests are done (2 s at most normally:
#: comm/callbacks.py's wait for gloo's callbacks)
EXIT_DEADLINE_S = 300


def pytest_unconfigure(config: pytest.Config) -> None:
    """A test process stuck at exit (a process group whose destructor waits for a collective
    no peer will join) prints every thread's stack and exits with status 1 after
    EXIT_DEADLINE_S, instead of holding the run until CI's own limit."""
    faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)


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
