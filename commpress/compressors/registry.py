"""Compressors by name, so new methods plug in without touching hooks or backends.

Registering wraps the constructor so that every construction, through :func:`build` or direct,
is first checked against its signature (:func:`commpress.schema.check_arguments`; see
:class:`~commpress.compressors.base.Compressor`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from commpress.compressors.base import Compressor
from commpress.errors import ConfigError
from commpress.schema import check_arguments, check_kwargs, signature_fields

__all__ = ["EXACT", "available", "build", "check_params", "compressor_class", "register_compressor"]

#: The method that averages exactly: uncompressed links and layers, and the steps before ``start_iter``.
EXACT = "none"

_REGISTRY: dict[str, type[Compressor]] = {}
C = TypeVar("C", bound=type[Compressor])


def register_compressor(cls: C) -> C:
    """Class decorator: register ``cls`` under ``cls.name``, its constructor arguments checked."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already registered")
    if cls.__init__ is not object.__init__ and not getattr(cls.__init__, "_checks_params", False):
        cls.__init__ = _checking(cls.__init__)  # type: ignore[method-assign]
    _REGISTRY[cls.name] = cls
    return cls


def _checking(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` with its arguments checked first and passed on converted."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Compressor, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments.update(check_arguments(f"method {self.name!r}", init, bound.arguments))
        init(*bound.args, **bound.kwargs)

    __init__._checks_params = True  # type: ignore[attr-defined]
    return __init__


def available() -> list[str]:
    """Names of every registered compressor."""
    return sorted(_REGISTRY)


def methods_taking(dtype: torch.dtype) -> list[str]:
    """The methods taking gradients of ``dtype``, :data:`EXACT` first (for dtype error messages)."""
    return sorted((m for m in available() if dtype in _REGISTRY[m].dtypes), key=lambda m: (m != EXACT, m))


def compressor_class(method: str) -> type[Compressor]:
    """The class registered as ``method``, or a ConfigError listing the accepted names."""
    if not isinstance(method, str):
        raise ConfigError(f"method = {method!r} is not accepted; expected a compressor name, one of: {', '.join(available())}")
    try:
        return _REGISTRY[method]
    except KeyError:
        raise ConfigError(f"method = {method!r} is not a known compressor; accepted: {', '.join(available())}") from None


def check_params(method: str, params: Mapping[str, Any], belongs: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Validate parameter names and types for ``method`` (ranges are checked on build);
    ``belongs(key)`` says where an unknown key belongs instead."""
    cls = compressor_class(method)
    return check_kwargs(f"method {method!r}", params, signature_fields(cls.__init__), belongs)


def build(method: str, params: Mapping[str, Any] | None = None) -> Compressor:
    """A new compressor instance of ``method`` with validated ``params``."""
    return compressor_class(method)(**check_params(method, params or {}))
