"""DDP's logging data name commpress's comm hook by the hook's own name (DDP records a
hook's ``__qualname__``), not by the removable wrapper it is registered through, as
PyTorch's ``test_ddp_comm_hook_logging`` expects of any registered hook."""

from __future__ import annotations

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
CONFIGS = {
    "ddp_hook": {"method": "powersgd"},
    "local_gradients_hook": {"local_sgd": {"algorithm": "diloco", "period": 2}},
    "comm_hook": {"method": "onebit", "onebit_adam": {"warmup": 1}},
}


def _names(rank: int, world_size: int) -> dict[str, str]:
    from torch.nn.parallel import DistributedDataParallel

    import commpress

    names = {}
    for expected, cfg in CONFIGS.items():
        model = DistributedDataParallel(torch.nn.Linear(8, 4))
        opt = torch.optim.AdamW(model.parameters())
        with commpress.register(model, cfg, optimizer=opt):
            model(torch.randn(2, 8)).sum().backward()  # the logging data are filled at the first iteration
            opt.step()
            names[expected] = model._get_ddp_logging_data().get("comm_hook")
    return names


def test_ddp_logging_names_the_hook_itself():
    (names,) = run_local(_names, 1)
    assert names == {name: name for name in CONFIGS}
