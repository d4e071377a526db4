"""Reading the ``[fsdp]`` table (its schema, :class:`~commpress.config.tables.FSDPConfig`,
lives with the other tables) from whatever a user hands :func:`commpress.fsdp.apply`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from commpress.config import Config
from commpress.config.tables import APPLIED_BY, TABLES, FSDPConfig
from commpress.errors import ConfigError

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
    config = Config.load(source)
    ignored = [f"[{t}]" for t in ("local_sgd", "bandwidth", "layerwise") if config.section(t) is not None]
    if config.method != "none" or config.overrides or config.start_iter:
        ignored.append(f"method = {config.method!r} (and its params/overrides/start_iter)")
    if ignored:
        raise ConfigError(
            f"commpress.fsdp.apply applies only the [fsdp] table; this config also sets {', '.join(ignored)}: "
            "those are for " + "; ".join(APPLIED_BY[t] for t in ("bandwidth", "local_sgd")) + "; give FSDP its own config"
        )
    section = config.section("fsdp")
    return section if section is not None else FSDPConfig()
