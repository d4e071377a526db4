"""``Config.section`` hands back each table's own settings class, and refuses a name that is no table."""

import pytest

from commpress import Config
from commpress.config.tables import TABLE_TYPES


def test_each_table_comes_back_as_its_class_and_an_absent_one_as_none():
    cfg = Config.load({name: {} for name in TABLE_TYPES})
    for name, cls in TABLE_TYPES.items():
        assert type(cfg.section(name)) is cls
        assert Config.load({}).section(name) is None


def test_a_name_that_is_no_table_is_refused_with_the_tables():
    with pytest.raises(ValueError, match="no config table is called 'localsgd'; the tables: local_sgd, fsdp"):
        Config.load({}).section("localsgd")


def test_declared_bounds_are_checked_after_the_type_and_said_in_the_error():
    from commpress.config.tables import BandwidthConfig, LocalSGDConfig
    from commpress.errors import ConfigError
    from commpress.schema import Bounds

    assert Bounds(ge=1).describe(int) == "an integer >= 1"
    assert Bounds(gt=0, le=1).describe(float) == "a number in (0, 1]"
    assert Bounds(lt=0.5, note="a fraction").describe(float) == "a number < 0.5 (a fraction)"
    assert LocalSGDConfig(qsr_alpha=None).qsr_alpha is None  # the bound is the number's, not the None's
    with pytest.raises(ConfigError, match=r"^local_sgd: qsr_alpha = -1.0 is not accepted; expected a number > 0$"):
        LocalSGDConfig(qsr_alpha=-1.0)
    with pytest.raises(ConfigError, match=r"^local_sgd: qsr_alpha = 'x' is not accepted; expected a finite number or none$"):
        LocalSGDConfig(qsr_alpha="x")  # a wrong type is named as a type
    probe = r"^\[bandwidth\] probe_ms = 20000.0 is not accepted; expected a number in \(0, 10000\]$"
    with pytest.raises(ConfigError, match=probe):
        BandwidthConfig(probe_ms=20_000)
