"""No config table is silently ignored: each entry point applies its own tables and names
where any other applies (``commpress.register`` applies every table that fits the model;
tests/test_register.py runs it)."""

from __future__ import annotations

import pytest
import torch

import commpress.fsdp
from commpress import CommState, ConfigError
from commpress.fsdp import load_fsdp_config
from commpress.local_sgd import from_config


@pytest.mark.parametrize(
    ("table", "where"),
    [
        ({"local_sgd": {"period": 4}}, r"commpress\.register\(model, config, optimizer=optimizer\)"),
        ({"fsdp": {"grad_bits": 8}}, r"commpress\.register\(model, config\) on a model sharded with fully_shard"),
        ({"onebit_adam": {"warmup": 1}}, r"commpress\.register\(ddp_model, config, optimizer=adamw\)"),
    ],
)
def test_the_ddp_hook_refuses_tables_it_does_not_apply(table, where):
    with pytest.raises(ConfigError, match=where):
        CommState({"method": "none", **table})


def test_local_sgd_refuses_fsdp_and_bandwidth_tables():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"applies \[local_sgd\] only .*apply \[fsdp\] with .* on a model sharded with"):
        from_config(model, opt, {"local_sgd": {"period": 2}, "fsdp": {}})
    with pytest.raises(ConfigError, match=r"applies \[local_sgd\] only .*the config's \[bandwidth\] cannot apply"):
        from_config(model, opt, {"local_sgd": {"period": 2}, "bandwidth": {"adaptive": True}})


@pytest.mark.parametrize(
    "config",
    [
        {"method": "powersgd"},
        {"local_sgd": {"period": 2}},
        {"bandwidth": {"adaptive": True}},
        {"method": "none", "start_iter": 3},
        {"onebit_adam": {"warmup": 1}},
    ],
)
def test_fsdp_refuses_what_it_does_not_apply(config):
    with pytest.raises(ConfigError, match=r"commpress\.fsdp\.apply applies \[fsdp\] only .*cannot apply"):
        load_fsdp_config({**config, "fsdp": {"grad_bits": 8}})


def test_fsdp_apply_on_an_unsharded_module_says_so():
    with pytest.raises(TypeError, match=r"found no sharded module in Sequential: call it after fully_shard"):
        commpress.fsdp.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"grad_bits": 8})
