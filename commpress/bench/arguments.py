"""The commands' argparse types: method lists (the grammar of :mod:`commpress.cmdline`), plain
lists, names, and numbers whose range the error states. Pure Python, no torch, so ``--help`` and a
mistyped option answer at once."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import TypeVar

from commpress.errors import ConfigError

__all__ = ["LIST_HELP", "choice", "integer", "listed", "method_list", "number", "split_method_list"]

T = TypeVar("T")

#: How a ``--help`` line states the method-list grammar.
LIST_HELP = "methods separated by ';' or ',', each NAME or NAME:key=value,key=value"


def _is_setting(piece: str) -> bool:
    """``key=value`` (a setting of the method before it), not ``name`` or ``name:...``."""
    return "=" in piece.partition(":")[0]


def split_method_list(text: str) -> list[str]:
    """``"none,powersgd:rank=4;topk"`` -> ``["none", "powersgd:rank=4", "topk"]`` (the module's
    grammar); ConfigError for a setting before any method or after a bare name, a spec without a
    name, or one named twice."""
    specs: list[str] = []
    for chunk in text.split(";"):
        in_chunk = 0
        for piece in (p.strip() for p in chunk.split(",")):
            if not piece:
                continue
            if not _is_setting(piece):
                name = piece.partition(":")[0].strip()
                if not name:
                    raise ConfigError(f"{piece!r} has no method name; expected NAME or NAME:key=value,...")
                specs.append(piece)
                in_chunk += 1
            elif not in_chunk:
                raise ConfigError(f"setting {piece!r} follows no method; settings go after NAME:, e.g. 'topk:ratio=0.01,{piece}'")
            elif ":" not in specs[-1]:
                raise ConfigError(f"setting {piece!r} follows {specs[-1]!r} without a colon; write '{specs[-1]}:{piece}'")
            else:
                specs[-1] += "," + piece
    for i, spec in enumerate(specs):
        if spec in specs[:i]:
            raise ConfigError(f"{spec!r} is named twice")
    return specs


def _argument_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """``parse`` as an argparse type called ``name``: its ConfigError becomes argparse's error."""

    def checked(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = name
    return checked


def method_list(*, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """An argparse ``type``: a method list (the module's grammar) -> its specs."""

    def parse(text: str) -> list[str]:
        try:
            specs = split_method_list(text)
        except ConfigError as exc:
            raise ConfigError(f"{text!r} is not accepted: {exc}") from None
        if not specs and not allow_empty:
            raise ConfigError(f"{text!r} names no method; expected {LIST_HELP}")
        return specs

    return _argument_type(parse, "method list")


def listed(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse ``type``: items separated by ``,`` or ``;``, each read by ``item`` (an
    argparse type such as :func:`integer` or :func:`choice`); at least one."""

    def parse(text: str) -> list[T]:
        pieces = [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]
        if not pieces:
            raise ConfigError(f"{text!r} names nothing; expected items separated by ',' or ';'")
        try:
            return [item(p) for p in pieces]
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(str(exc)) from None

    return _argument_type(parse, "list")


def choice(names: Iterable[str]) -> Callable[[str], str]:
    """An argparse ``type``: one of ``names`` (the error lists them)."""
    accepted = tuple(names)

    def parse(text: str) -> str:
        if text not in accepted:
            raise ConfigError(f"{text!r} is not accepted; accepted: {', '.join(accepted)}")
        return text

    return _argument_type(parse, "name")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [low, high] (no upper bound when ``high`` is None)."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise ConfigError(f"{text!r} is not accepted; expected {expected}")
        return value

    return _argument_type(parse, "integer")


def number(low: float, high: float | None = None, *, low_open: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number above ``low`` (or at it, ``low_open=False``), at
    most ``high``; the error states the range, e.g. "a number in (0, 1]"."""
    if high is None:
        expected = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        expected = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise ConfigError(f"{text!r} is not accepted; expected {expected}")
        return value

    return _argument_type(parse, "number")
