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
