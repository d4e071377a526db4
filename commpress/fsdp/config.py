"""Reading the ``[fsdp]`` table (its schema, :class:`~commpress.config.tables.FSDPConfig`,
lives with the other tables) from whatever a user hands :func:`commpress.fsdp.apply`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from commpress.config import Config
from commpress.config.keys import TOP_LEVEL, belongs
from commpress.config.matrix import check_part
from commpress.config.tables import TABLE_TYPES, FSDPConfig, parse_table

__all__ = ["load_fsdp_config"]

#: Keys that mark a dict as a whole commpress config rather than the ``[fsdp]`` table.
_CONFIG_KEYS = {*TOP_LEVEL, *TABLE_TYPES}


def load_fsdp_config(source: Any = None) -> FSDPConfig:
    """An FSDPConfig from itself, a :class:`commpress.Config` or a dict or TOML/JSON path holding
    an ``[fsdp]`` table, the table's keys as a dict, or None (defaults)."""
    if source is None:
        return FSDPConfig()
    if isinstance(source, FSDPConfig):
        return source
    if isinstance(source, Mapping) and not set(source) & _CONFIG_KEYS:
        return parse_table("fsdp", source, functools.partial(belongs, here="[fsdp]"))  # the table's keys alone
    config = Config.load(source)
    check_part(config, "fsdp", "commpress.fsdp.apply")
    section = config.section("fsdp")
    return section if section is not None else FSDPConfig()
