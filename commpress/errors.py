"""Exceptions shared by every subsystem."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is unknown, out of range, or differs across ranks.

    The message names the key, the value given and what is accepted.
    """
