"""Where every config key lives, so that a key in the wrong place is answered with where it
belongs (``rank`` at the top level: ``[params]``), not only with the keys accepted there."""

from __future__ import annotations

import dataclasses

from commpress.compressors import available, compressor_class
from commpress.config.tables import TABLE_TYPES
from commpress.schema import signature_fields

__all__ = ["OVERRIDE_KEYS", "TOP_LEVEL", "TOP_LEVEL_HOME", "belongs", "homes"]

#: Keys of the top level besides the tables.
TOP_LEVEL = ("method", "params", "start_iter", "backend", "overrides")
#: The top level, as :func:`homes` names it.
TOP_LEVEL_HOME = "the top level (before any [table])"
#: Keys of one ``[[overrides]]`` entry.
OVERRIDE_KEYS = ("params", "method", "method_params")


def homes(key: str) -> list[str]:
    """Every place in a config where ``key`` is accepted, named as in a TOML file."""
    out = []
    if key in TOP_LEVEL or key in TABLE_TYPES:
        out.append(TOP_LEVEL_HOME)
    methods = [m for m in available() if key in signature_fields(compressor_class(m).__init__)]
    if methods:
        out.append(f"[params] of method {' or '.join(methods)}")
    out += [f"[{name}]" for name, cls in TABLE_TYPES.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if key in OVERRIDE_KEYS:
        out.append("[[overrides]]")
    return out


def belongs(key: str, here: str = "") -> str:
    """The text an unknown-key error puts after ``key`` found at ``here``: ``": it belongs in
    <places>"`` (the other :func:`homes`), or ``""`` when no place takes it."""
    places = []
    for home in homes(key):
        if home == here:
            continue
        if here == "[[overrides]]" and home.startswith("[params]"):
            home = "this override's method_params" + home.removeprefix("[params]")
        places.append(f"at {home}" if home == TOP_LEVEL_HOME else f"in {home}")
    return f": it belongs {' or '.join(places)}" if places else ""
