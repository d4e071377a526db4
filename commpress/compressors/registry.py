"""Compressors by name, so new methods plug in without touching hooks or backends.

A registered compressor's constructor keyword arguments are its config parameters, and
their type hints declare what each accepts (``ratio: Annotated[float, Bounds(gt=0, le=1)]``):
registering wraps the constructor so that every construction, through :func:`build` or
direct, is checked against them by :func:`commpress.schema.check_arguments` first. The
constructor itself checks only what a type and a range cannot say (rules between
parameters, multiples).
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

#: The method that averages exactly, the reference: what a link or a layer sends when it is
#: not compressed, and the steps before ``start_iter``.
EXACT = "none"

_REGISTRY: dict[str, type[Compressor]] = {}
C = TypeVar("C", bound=type[Compressor])


def register_compressor(cls: C) -> C:
    """Class decorator: make ``cls`` available under ``cls.name``, its constructor's
    arguments checked against their declared types and ranges."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already registered")
    if cls.__init__ is not object.__init__ and not getattr(cls.__init__, "_checks_params", False):
        cls.__init__ = _checking(cls.__init__)  # type: ignore[method-assign]
    _REGISTRY[cls.name] = cls
    return cls


def _checking(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` with its arguments checked first (``method 'topk': ratio = 2.0 is not
    accepted; expected a number in (0, 1]``) and passed on converted."""
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
    """The registered methods whose compressors take gradients of ``dtype``: :data:`EXACT`
    first, then by name; what error messages about a refused dtype suggest."""
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
    """Validate parameter names and types for ``method`` (ranges are checked on build, with
    the rules between parameters);
    ``belongs(key)`` says where an unknown key belongs instead (the config knows)."""
    cls = compressor_class(method)
    return check_kwargs(f"method {method!r}", params, signature_fields(cls.__init__), belongs)


def build(method: str, params: Mapping[str, Any] | None = None) -> Compressor:
    """A new compressor instance of ``method`` with validated ``params``."""
    cls = compressor_class(method)
    return cls(**check_params(method, params or {}))
