"""A method spec in one string, as a config may give it (``"powersgd:rank=4"``) and every command's
method list reads it (:mod:`commpress.bench.arguments`). Pure Python, no torch.

The method-list grammar, the same in every command (``--methods``, ``--adaptive``, ``--rows``)::

    list    = method { (";" | ",") method }
    method  = name [ ":" setting { "," setting } ]
    setting = key "=" value

A comma followed by ``key=value`` adds a setting to the method before it, any other comma starts
a new method: ``none,powersgd:rank=4,start_iter=20,topk`` is three methods. Values are TOML
values (numbers, booleans, quoted strings) or else bare strings, and hold no ``,`` or ``;``.
"""

from __future__ import annotations

import tomllib
from typing import Any

from commpress.errors import ConfigError

__all__ = ["parse_method_spec", "parse_settings"]


def parse_settings(text: str, where: str) -> list[tuple[str, Any]]:
    """``"rank=4,warm_start=false"`` -> ``[("rank", 4), ("warm_start", False)]`` (values as in the
    module's grammar); ``where`` names the setting in errors."""
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq:
            raise ConfigError(f"{where}: {item!r} is not key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        pairs.append((key, value))
    return pairs


def parse_method_spec(spec: str) -> dict[str, Any]:
    """``"powersgd:rank=4,start_iter=2"`` -> ``{"method": "powersgd", "params": {"rank": 4}, ...}``:
    ``start_iter`` and ``backend`` go to the top level, everything else to ``params``."""
    method, _, rest = spec.partition(":")
    out: dict[str, Any] = {"method": method.strip(), "params": {}}
    for key, value in parse_settings(rest, f"method spec {spec!r}"):
        (out if key in ("start_iter", "backend") else out["params"])[key] = value
    return out
