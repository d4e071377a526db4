"""Reading a config file: TOML or JSON by suffix, one schema (JSON for users whose launcher
settings are JSON, as DeepSpeed's are)."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import PurePath
from typing import Any

from commpress.compressors import available
from commpress.errors import ConfigError

__all__ = ["SUFFIXES", "read_config_file"]

#: The config file formats, by suffix.
SUFFIXES = (".toml", ".json")


def read_config_file(source: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in the TOML or JSON file at ``source``; ConfigError (naming the path)
    when it cannot be read, has another suffix, or is not valid in its format."""
    path = os.fspath(source)
    if not path:
        raise ConfigError("config file '' is not accepted; expected the path of a .toml or .json file")
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"config file {path!r} is a directory; expected a .toml or .json file")
    if not stat.S_ISREG(mode):  # a FIFO or a device could block or never end
        raise ConfigError(f"config file {path!r} is not a regular file; expected a .toml or .json file")
    suffix = PurePath(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"config file {path!r} has suffix {suffix or '(none)'!r}; accepted: .toml (TOML) or .json (JSON), "
            "the same keys and tables in either"
        )
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh) if suffix == ".toml" else json.load(fh, object_pairs_hook=_object)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid JSON: {exc}") from None
    except _RepeatedKey as exc:
        raise ConfigError(f"config file {path!r}: key {exc.args[0]!r} appears twice in one JSON object") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start}); config files are UTF-8") from None
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if not isinstance(data, dict):  # a JSON file holds one object, as a TOML file holds one table
        raise ConfigError(f"config file {path!r} holds a JSON {type(data).__name__}; expected one object of settings")
    return data


class _RepeatedKey(Exception):
    """A key given twice in one JSON object."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when a key repeats (as TOML refuses it; JSON keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _unreadable(path: str, exc: Exception) -> ConfigError:
    if isinstance(exc, FileNotFoundError):
        if path in available():  # register(model, "bf16"): a method name, not a file
            return ConfigError(
                f"config file {path!r} does not exist; {path!r} is a method name: to choose it without a file, "
                f'pass a dict: {{"method": "{path}"}}'
            )
        return ConfigError(f"config file {path!r} does not exist")
    if isinstance(exc, OSError):  # permissions, symlink loops, names too long, ...
        return ConfigError(f"config file {path!r} cannot be read: {exc.strerror or exc}")
    return ConfigError(f"config file {path!r} is not accepted: {exc}")  # a NUL character
