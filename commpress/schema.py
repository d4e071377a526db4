"""Checks settings (compressor parameters, config tables) against type hints, so every config
error names key, value and what is accepted. A number's range is declared in its hint too
(``Annotated[int, Bounds(ge=1)]``). A ``float`` must be finite: no setting means anything at
infinity or NaN, and letting one through only moves the failure into training.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from commpress.errors import ConfigError

__all__ = ["Bounds", "check_arguments", "check_fields", "check_keys", "check_kwargs", "parse_dataclass", "signature_fields"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a number must fall in, declared beside its type and checked once the type holds;
    ``note`` adds what the number means to the error."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self, tp: Any, finite: bool = False) -> str:
        """What a value must be (``finite``: say so of a float, for a value refused by type)."""
        kind = "an integer" if tp is int else "a finite number" if finite else "a number"
        low = ("[", ">=", self.ge) if self.ge is not None else ("(", ">", self.gt) if self.gt is not None else None
        high = ("]", "<=", self.le) if self.le is not None else (")", "<", self.lt) if self.lt is not None else None
        if low and high:
            text = f"{kind} in {low[0]}{_number(low[2])}, {_number(high[2])}{high[0]}"
        elif low or high:
            _, op, bound = low or high
            text = f"{kind} {op} {_number(bound)}"
        else:
            text = kind
        return f"{text} ({self.note})" if self.note else text


def _number(bound: float) -> str:
    """A bound as written: a large power of two as ``2**n`` (a seed's ``2**63``)."""
    if isinstance(bound, int) and bound >= 2**32 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return f"{bound:g}"


def _annotated(tp: Any) -> tuple[Any, Bounds | None]:
    """An ``Annotated`` type's inner type and its first :class:`Bounds` (None without one)."""
    inner, *extras = typing.get_args(tp)
    return inner, next((e for e in extras if isinstance(e, Bounds)), None)


def _bounds(tp: Any, value: Any) -> tuple[Any, Bounds] | None:
    """(the type, its Bounds) that ``value``, already type-checked, falls under, or None."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, found = _annotated(tp)
        return (inner, found) if found is not None else None
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            if _coerce(value, arg)[0]:
                return _bounds(arg, value)
    return None


def _describe(tp: Any, ranged: bool = True) -> str:
    """What type ``tp`` accepts; with ``ranged``, a number's declared range too (not for a union's members)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, found = _annotated(tp)
        return found.describe(inner, finite=True) if found is not None and ranged else _describe(inner)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a, ranged=False) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "none"
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for ``value`` against type ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is typing.Annotated:
        return _coerce(value, typing.get_args(tp)[0])
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            ok, conv = _coerce(value, arg)
            if ok:
                return True, conv
        return False, value
    if origin in (tuple, list):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return False, value
        (item,) = typing.get_args(tp)[:1]
        coerced = [_coerce(v, item) for v in value]
        if not all(ok for ok, _ in coerced):
            return False, value
        return True, tuple(conv for _, conv in coerced)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        try:
            conv = float(value)
        except OverflowError:  # an integer too large for a float
            return False, value
        return math.isfinite(conv), conv
    return isinstance(value, tp), value  # None, bool, str, a class


def check_keys(where: str, data: Any) -> None:
    """Raise ConfigError unless ``data`` is a table (mapping) whose keys are all strings."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table of settings, got {data!r}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is not accepted; setting names are strings")


def check_kwargs(
    where: str,
    data: Mapping[str, Any],
    fields: Mapping[str, tuple[Any, bool]],
    belongs: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """Validate ``data`` against ``fields`` (name -> (type, required)); return converted
    values. ``belongs(key)``: text that says where an unknown key belongs instead."""
    check_keys(where, data)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        accepted = ", ".join(sorted(fields)) or "none"
        hint = belongs(unknown[0]) if belongs is not None else ""
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}{hint}; accepted keys: {accepted}")
    missing = [k for k, (_, required) in fields.items() if required and k not in data]
    if missing:
        raise ConfigError(f"{where}: missing required key {missing[0]!r}")
    return _converted(where, {k: fields[k][0] for k in data}, data)


@functools.cache
def signature_fields(fn: Callable[..., Any]) -> dict[str, tuple[Any, bool]]:
    """The keyword parameters of ``fn`` as :func:`check_kwargs` fields (cached: do not change it)."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return {
        p.name: (hints.get(p.name, Any), p.default is inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


@functools.cache
def _dataclass_fields(cls: type) -> dict[str, tuple[Any, bool]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.init
    }


def parse_dataclass(where: str, cls: type[T], data: Mapping[str, Any], belongs: Callable[[str], str] | None = None) -> T:
    """Build dataclass ``cls`` from ``data`` (``belongs``: as for :func:`check_kwargs`)."""
    return cls(**check_kwargs(where, data, _dataclass_fields(cls), belongs))


def check_fields(where: str, obj: Any, key: str = "{where}: {key}", names: tuple[str, ...] | None = None) -> None:
    """Check the fields of the frozen dataclass ``obj`` (or those in ``names``) against their hints
    and :class:`Bounds`, storing the converted values; ``__post_init__`` calls it, so a table
    built directly meets the rules of one parsed. ``key``: how a range error names the key."""
    fields = {k: tp for k, (tp, _) in _dataclass_fields(type(obj)).items() if names is None or k in names}
    for name, value in _check_values(where, fields, {k: getattr(obj, k) for k in fields}, key).items():
        object.__setattr__(obj, name, value)


def check_arguments(where: str, fn: Callable[..., Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` of a call to ``fn``, checked against its hints as :func:`check_fields` checks a
    dataclass, returned converted."""
    fields = {k: tp for k, (tp, _) in signature_fields(fn).items() if k in arguments}
    return {**arguments, **_check_values(where, fields, {k: arguments[k] for k in fields})}


def _check_values(
    where: str, fields: Mapping[str, Any], values: Mapping[str, Any], key: str = "{where}: {key}"
) -> dict[str, Any]:
    """``values`` converted to their ``fields`` types, every type checked before any range."""
    out = _converted(where, fields, values)
    for name, tp in fields.items():
        found = _bounds(tp, out[name])
        if found is not None and not found[1].holds(out[name]):
            named = key.format(where=where, key=name)
            raise ConfigError(f"{named} = {out[name]!r} is not accepted; expected {found[1].describe(found[0])}")
    return out


def _converted(where: str, fields: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` converted to their ``fields`` types (name -> type), refusing the first that is not one."""
    out = {}
    for name, tp in fields.items():
        ok, conv = _coerce(values[name], tp)
        if not ok:
            raise ConfigError(f"{where}: {name} = {values[name]!r} is not accepted; expected {_describe(tp)}")
        out[name] = conv
    return out
