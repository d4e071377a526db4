"""Reading the ``[fsdp]`` table (its schema, :class:`~commpress.config.tables.FSDPConfig`,
lives with the other tables) from whatever a user hands :func:`commpress.fsdp.apply`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from commpress.compressors import EXACT
from commpress.config import Config
from commpress.config.keys import TOP_LEVEL, belongs
from commpress.config.tables import TABLE_TYPES, FSDPConfig, parse_table
from commpress.errors import ConfigError

__all__ = ["check_sharded_config", "load_fsdp_config"]

#: Keys that mark a dict as a whole commpress config rather than the ``[fsdp]`` table.
_CONFIG_KEYS = {*TOP_LEVEL, *TABLE_TYPES}


def load_fsdp_config(source: Any = None) -> FSDPConfig:
    """An FSDPConfig from itself, a :class:`commpress.Config` (its ``[fsdp]`` table), a
    dict holding an ``fsdp`` table or the table's keys, or the path of a TOML or JSON file."""
    if source is None:
        return FSDPConfig()
    if isinstance(source, FSDPConfig):
        return source
    if isinstance(source, Mapping) and not set(source) & _CONFIG_KEYS:
        return parse_table("fsdp", source, functools.partial(belongs, here="[fsdp]"))  # the table's keys alone
    config = Config.load(source)
    check_sharded_config(config)
    section = config.section("fsdp")
    return section if section is not None else FSDPConfig()


def check_sharded_config(config: Config) -> None:
    """Refuse, saying why, what a config sets that does not apply to a sharded model."""
    why = []
    if config.method != EXACT or config.params or config.overrides or config.start_iter:
        why.append(
            f"method = {config.method!r} (with its params, overrides, start_iter) compresses DDP's gradient buckets; "
            "a sharded model's collectives are set by [fsdp] (grad_bits, weight_bits)"
        )
    if config.backend != "torch":
        why.append(f"backend = {config.backend!r}: FSDP's collectives run on its torch.distributed process group")
    if config.section("local_sgd") is not None:
        why.append("[local_sgd] averages whole models held by every rank; a sharded model is split across ranks")
    if config.section("bandwidth") is not None:
        why.append("[bandwidth] plans the DDP hook's gradient reduction; FSDP's collectives are not planned by it")
    if config.section("layerwise") is not None:
        why.append("[layerwise] plans the DDP hook's per-tensor settings; FSDP's collectives are set by [fsdp]")
    if why:
        raise ConfigError(
            "this config does not apply to a sharded (FSDP) model: " + "; ".join(why) + "; give it a config with [fsdp] only"
        )
