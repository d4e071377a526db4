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
    diloco = Config.load({"local_sgd": DILOCO}).section("local_sgd")  # the measured outer step; unset keys: defaults
    keys = ("outer_lr", "outer_momentum", "nesterov", "fragments", "sync_delay", "merge", "merge_alpha")
    assert [diloco.value(k) for k in keys] == [0.8, 0.2, True, 1, 0, "eager", 0.0]
    mixed = Config.load({"local_sgd": DILOCO | {"merge_alpha": 0.5}}).section("local_sgd")  # the paper's mix, as given
    assert (mixed.value("merge"), mixed.value("merge_alpha")) == ("mix", 0.5)
    co2 = Config.load({"local_sgd": CO2}).section("local_sgd")
    assert [co2.value(k) for k in ("outer_lr", "outer_momentum", "staleness_penalty", "clip")] == [1.0, 0.0, 1.0, None]


CO2 = {"algorithm": "co2"}
DILOCO = {"algorithm": "diloco"}


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"period": 0}, "local_sgd: period = 0 is not accepted; expected an integer >= 1"),
        ({"algorithm": "dilco"}, "local_sgd: algorithm = 'dilco' is not accepted; expected one of 'local_sgd', 'co2', 'diloco'"),
        ({"qsr_alpha": -1.0}, "local_sgd: qsr_alpha = -1.0"),
        ({"qsr_alpha": float("inf")}, "local_sgd: qsr_alpha = inf is not accepted; expected a finite number or none"),
        ({"outer_lr": float("inf")}, "local_sgd: outer_lr = inf is not accepted; expected a finite number"),
        ({"period": True}, "local_sgd: period = True is not accepted; expected an integer"),
        (CO2 | {"staleness_penalty": 0.5}, "staleness_penalty = 0.5 is not accepted; expected a number >= 1 or 'adaptive'"),
        (CO2 | {"outer_momentum": 1.0}, "outer_momentum = 1.0 is not accepted; expected a number in [0, 1)"),
        (CO2 | {"outer_lr": 0}, "outer_lr = 0.0 is not accepted"),
        (CO2 | {"clip": -1}, "clip = -1.0 is not accepted"),
        (DILOCO | {"outer_lr": -0.7}, "local_sgd: outer_lr = -0.7 is not accepted; expected a number > 0"),
        (DILOCO | {"outer_momentum": 0.0}, "local_sgd: nesterov = true is not accepted with outer_momentum = 0"),
        (DILOCO | {"fragments": 0}, "local_sgd: fragments = 0 is not accepted; expected an integer >= 1"),
        (DILOCO | {"sync_delay": -1}, "local_sgd: sync_delay = -1 is not accepted; expected an integer >= 0"),
        (DILOCO | {"merge_alpha": 1.0}, "local_sgd: merge_alpha = 1.0 is not accepted; expected a number in [0, 1)"),
        (DILOCO | {"merge": "average"}, "local_sgd: merge = 'average' is not accepted; expected one of 'eager', 'mix'"),
        (
            DILOCO | {"merge": "eager", "merge_alpha": 0.5},
            "local_sgd: merge_alpha = 0.5 is not accepted with merge = 'eager'; expected merge = 'mix'",
        ),
        (CO2 | {"merge": "mix"}, "merge = 'mix' does not apply to algorithm = 'co2'; it applies to algorithm = 'diloco'"),
        (DILOCO | {"nesterov": 1}, "local_sgd: nesterov = 1 is not accepted; expected"),
        (
            {"outer_lr": 0.7},
            "outer_lr = 0.7 does not apply to algorithm = 'local_sgd'; it applies to algorithm = 'co2' or",
        ),
        (DILOCO | {"clip": 1.0}, "local_sgd: clip = 1.0 does not apply to algorithm = 'diloco'; it applies to algorithm = 'co2'"),
        (DILOCO | {"fragments": 2, "period": 5}, "local_sgd: period = 5 is not accepted with fragments = 2; expected a multiple"),
        (
            DILOCO | {"fragments": 2, "sync_delay": 3},
            "sync_delay = 3 is not accepted with period = 4 and fragments = 2",
        ),
        (DILOCO | {"sync_delay": 1, "qsr_alpha": 0.1}, "local_sgd: fragments = 1 and sync_delay = 1 need a constant period"),
        (
            CO2 | {"fragments": 4},
            "fragments = 4 does not apply to algorithm = 'co2'; it applies to algorithm = 'diloco'",
        ),
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
        ({"local_sgd": {}, "start_iter": 3}, "the config's start_iter cannot apply: start_iter applies with the DDP hook"),
        ({"local_sgd": {}, "overrides": [{"params": ["*.bias"], "method": "none"}]}, "the config's overrides cannot apply"),
    ],
)
def test_from_config_refuses_what_it_cannot_do(config, needle):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        from_config(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
