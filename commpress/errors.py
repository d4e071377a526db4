"""Exceptions shared by every subsystem."""

from __future__ import annotations

__all__ = ["CollectiveError", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value is unknown, out of range, or differs across ranks; the message names
    the key, the value given and what is accepted."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, stalled, or disagreed); the original error is
    the ``__cause__``. Every rank that sees it must stop: its data is not the average."""
