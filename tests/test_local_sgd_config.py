"""The [local_sgd] config table: defaults, policies, and clear errors."""

from __future__ import annotations

import pytest
import torch

from commpress.config import Config, ConfigError
from commpress.local_sgd import QSR, Constant, from_config
from commpress.local_sgd.config import period_policy


def test_defaults_and_period_policy():
    cfg = Config.load({"method": "bf16", "local_sgd": {"period": 3}})
    section = cfg.section("local_sgd")
    assert section.algorithm == "local_sgd" and isinstance(period_policy(section), Constant)
    qsr = period_policy(Config.load({"local_sgd": {"period": 4, "qsr_alpha": 0.0175, "warmup_steps": 5}}).section("local_sgd"))
    assert isinstance(qsr, QSR) and qsr.next(step=5, lr=0.0040005) == 19 and qsr.next(step=4, lr=0.0040005) == 4
    assert Config.load(cfg.to_dict()).digest() == cfg.digest()


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"period": 0}, "local_sgd: period = 0 is not accepted; expected an integer >= 1"),
        ({"algorithm": "diloco"}, "local_sgd: algorithm = 'diloco' is not accepted; expected one of 'local_sgd', 'co2'"),
        ({"qsr_alpha": -1.0}, "local_sgd: qsr_alpha = -1.0"),
        ({"qsr_alpha": float("inf")}, "local_sgd: qsr_alpha = inf is not accepted; expected a finite number or none"),
        ({"outer_lr": float("inf")}, "local_sgd: outer_lr = inf is not accepted; expected a finite number"),
        ({"period": True}, "local_sgd: period = True is not accepted; expected an integer"),
        ({"staleness_penalty": 0.5}, "staleness_penalty = 0.5 is not accepted; expected a number >= 1 or 'adaptive'"),
        ({"outer_momentum": 1.0}, "outer_momentum = 1.0 is not accepted; expected a number in [0, 1)"),
        ({"outer_lr": 0}, "outer_lr = 0.0 is not accepted"),
        ({"clip": -1}, "clip = -1.0 is not accepted"),
        ({"perod": 4}, "local_sgd: unknown key 'perod'; accepted keys: algorithm, average_buffers, clip"),
    ],
)
def test_bad_values_name_key_value_and_accepted(table, needle):
    with pytest.raises(ConfigError) as err:
        Config.load({"local_sgd": table})
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"method": "none"}, "the config has no [local_sgd] table"),
        ({"local_sgd": {}, "start_iter": 3}, "start_iter = 3 is not accepted with [local_sgd]"),
        ({"local_sgd": {}, "overrides": [{"params": ["*.bias"], "method": "none"}]}, "overrides are not accepted"),
    ],
)
def test_from_config_refuses_what_it_cannot_do(config, needle):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        from_config(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
