"""Reading the ``[fsdp]`` table (its schema, :class:`~commpress.config.tables.FSDPConfig`,
lives with the other tables) from whatever a user hands :func:`commpress.fsdp.apply`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from commpress.config import Config
from commpress.config.tables import TABLES, FSDPConfig

__all__ = ["load_fsdp_config"]

#: Keys that mark a dict as a whole commpress config rather than the ``[fsdp]`` table.
_CONFIG_KEYS = {"fsdp", "method", "params", "start_iter", "backend", "overrides", "local_sgd", "bandwidth"}


def load_fsdp_config(source: Any = None) -> FSDPConfig:
    """An FSDPConfig from itself, a :class:`commpress.Config` (its ``[fsdp]`` table), a
    dict holding an ``fsdp`` table or the table's keys, or the path of a TOML file."""
    if source is None:
        return FSDPConfig()
    if isinstance(source, FSDPConfig):
        return source
    if isinstance(source, Mapping) and not set(source) & _CONFIG_KEYS:
        return TABLES["fsdp"](source)  # the table's keys alone
    section = Config.load(source).section("fsdp")
    return section if section is not None else FSDPConfig()
