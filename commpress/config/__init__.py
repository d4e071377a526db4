"""One validated configuration, read from a TOML or JSON file or a dict; the top-level keys
choose the hooks' gradient compressor::

    method = "powersgd"        # any name in commpress.compressors.available()
    start_iter = 10            # uncompressed ("none") steps before compression starts
    backend = "torch"          # "torch" (torch.distributed) or "mpi" (mpi4py)

    [params]                   # the method's parameters
    rank = 4

    [[overrides]]              # per-parameter-name exceptions, first match wins
    params = ["*.bias", "*norm*"]
    method = "none"

The other tables are listed in :mod:`commpress.config.tables`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import os
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, overload

from commpress.cmdline import parse_method_spec, parse_settings
from commpress.compressors import build, check_params
from commpress.config.files import read_config_file
from commpress.config.keys import OVERRIDE_KEYS, TOP_LEVEL, TOP_LEVEL_HOME, belongs
from commpress.config.tables import (
    TABLE_TYPES,
    BandwidthConfig,
    DionConfig,
    FSDPConfig,
    LayerwiseConfig,
    LocalSGDConfig,
    OneBitAdamConfig,
    Table,
    parse_table,
)
from commpress.errors import ConfigError
from commpress.schema import Bounds, check_fields, check_keys

__all__ = ["BACKENDS", "Config", "ConfigError", "Override", "config_diff", "digest_of", "parse_method_spec", "parse_settings"]

#: Where the collectives run: torch.distributed or MPI (mpi4py).
Backend = Literal["torch", "mpi"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)


@dataclass(frozen=True)
class Override:
    """Parameters whose names match any glob in ``params`` use ``method`` instead."""

    params: tuple[str, ...]
    method: str
    method_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        patterns = [self.params] if isinstance(self.params, str) else self.params
        if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise ConfigError(f"params = {self.params!r} is not accepted; expected a list of parameter-name globs")
        object.__setattr__(self, "params", tuple(patterns))
        if not isinstance(self.method_params, Mapping):
            raise ConfigError(f"method_params = {self.method_params!r} is not accepted; expected a table of parameters")
        check_keys("method_params", self.method_params)
        object.__setattr__(self, "method_params", check_params(self.method, self.method_params, belongs))
        build(self.method, self.method_params)  # range checks happen in the compressor

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.params)


@dataclass(frozen=True)
class Config:
    """The resolved configuration. Build it with :meth:`load`."""

    method: str = "none"
    params: Mapping[str, Any] = field(default_factory=dict)
    start_iter: Annotated[int, Bounds(ge=0)] = 0
    backend: Backend = "torch"
    overrides: tuple[Override, ...] = ()
    sections: Mapping[str, Table] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"params = {self.params!r} is not accepted; expected a table of the method's parameters")
        check_keys("params", self.params)
        object.__setattr__(self, "params", check_params(self.method, self.params, belongs))
        check_fields("config", self, names=("start_iter", "backend"))  # the rest: parsed by their own rules
        build(self.method, self.params)
        if not isinstance(self.overrides, (list, tuple)) or not all(isinstance(o, Override) for o in self.overrides):
            raise ConfigError(f"overrides = {self.overrides!r} is not accepted; expected a list of Override")
        object.__setattr__(self, "overrides", tuple(self.overrides))

    @classmethod
    def load(cls, source: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None) -> Config:
        """A Config from a Config, a dict, or the path of a ``.toml`` or ``.json`` file (same keys)."""
        if source is None:
            return cls()
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_dict(read_config_file(source))
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        raise ConfigError(f"config must be a Config, a dict or the path of a .toml or .json file, got {type(source).__name__}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """A Config from TOML-shaped data (what :meth:`to_dict` returns)."""
        check_keys("config", data)
        data = dict(data)
        for key in data:
            if key not in TOP_LEVEL and key not in TABLE_TYPES:
                accepted = ", ".join([*TOP_LEVEL, *sorted(TABLE_TYPES)])
                raise ConfigError(f"unknown config key {key!r}{belongs(key, TOP_LEVEL_HOME)}; accepted keys: {accepted}")
        core = {k: data.pop(k) for k in ("method", "params", "start_iter", "backend") if k in data}
        overrides = data.pop("overrides", [])
        if not isinstance(overrides, (list, tuple)):
            raise ConfigError(f"overrides = {overrides!r} is not accepted; expected a list of tables ([[overrides]])")
        overrides = tuple(_parse_override(i, o) for i, o in enumerate(overrides))
        sections = {key: parse_table(key, value, functools.partial(belongs, here=f"[{key}]")) for key, value in data.items()}
        return cls(overrides=overrides, sections=sections, **core)

    @overload
    def section(self, name: Literal["local_sgd"]) -> LocalSGDConfig | None: ...
    @overload
    def section(self, name: Literal["fsdp"]) -> FSDPConfig | None: ...
    @overload
    def section(self, name: Literal["bandwidth"]) -> BandwidthConfig | None: ...
    @overload
    def section(self, name: Literal["layerwise"]) -> LayerwiseConfig | None: ...
    @overload
    def section(self, name: Literal["onebit_adam"]) -> OneBitAdamConfig | None: ...
    @overload
    def section(self, name: Literal["dion"]) -> DionConfig | None: ...
    @overload
    def section(self, name: str) -> Table | None: ...
    def section(self, name: str) -> Table | None:
        """The ``[name]`` table's settings, or None when the config has none; ValueError for a name
        that is no table (a misspelling would otherwise read as a table left out)."""
        if name not in TABLE_TYPES:
            raise ValueError(f"no config table is called {name!r}; the tables: {', '.join(TABLE_TYPES)}")
        return self.sections.get(name)

    def group_for(self, model: Any, process_group: Any = None) -> Any:
        """The process group a part of this config talks in: ``process_group`` if given, else on
        the torch backend the model's own (None: the world)."""
        if process_group is not None or self.backend != "torch":
            return process_group
        return getattr(model, "process_group", None)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (TOML-shaped), sorted and with defaults filled in."""
        out: dict[str, Any] = {
            "method": self.method,
            "params": dict(sorted(self.params.items())),
            "start_iter": self.start_iter,
            "backend": self.backend,
        }
        if self.overrides:
            out["overrides"] = [
                {"params": list(o.params), "method": o.method, "method_params": dict(o.method_params)} for o in self.overrides
            ]
        for name, sec in sorted(self.sections.items()):
            out[name] = dataclasses.asdict(sec)
        return out

    def digest(self) -> str:
        """A hash of the resolved config; ranks compare it at registration."""
        return digest_of(self.to_dict())

    def unmatched_overrides(self, names: Iterable[str]) -> list[str]:
        """The ``overrides`` globs that match none of ``names``, in config order: a mistyped pattern
        would otherwise change nothing without a word."""
        names = list(names)
        patterns = dict.fromkeys(p for ov in self.overrides for p in ov.params)
        return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _parse_override(i: int, raw: Any) -> Override:
    where = f"overrides[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} = {raw!r} is not accepted; expected a table with keys params, method, method_params")
    check_keys(where, raw)
    unknown = sorted(set(raw) - set(OVERRIDE_KEYS))
    if unknown:
        hint = belongs(unknown[0], "[[overrides]]")
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}{hint}; accepted keys: {', '.join(sorted(OVERRIDE_KEYS))}")
    try:
        return Override(raw.get("params"), raw.get("method", "none"), raw.get("method_params", {}))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def digest_of(data: Any) -> str:
    """A short hash of plain data (key order does not matter): what ranks compare to agree
    on settings without sending them."""
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_diff(saved: Any, current: Any, path: str = "") -> list[str]:
    """Each setting in which two configs as plain data (:meth:`Config.to_dict`) differ, as
    ``"key: saved value (saved) vs current value (now)"``, nested keys dotted."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in saved:
                out.append(f"{where}: not set (saved) vs {current[key]!r} (now)")
            elif key not in current:
                out.append(f"{where}: {saved[key]!r} (saved) vs not set (now)")
            else:
                out.extend(config_diff(saved[key], current[key], where))
        return out
    same = json.dumps(saved, sort_keys=True, default=str) == json.dumps(current, sort_keys=True, default=str)
    return [] if same else [f"{path or 'config'}: {saved!r} (saved) vs {current!r} (now)"]
