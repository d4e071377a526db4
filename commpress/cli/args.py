"""Argument types shared by the commands: argparse rejects an out-of-range value with one
line naming the option, before a command starts any rank."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["integer", "number"]


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [low, high] (no upper bound when ``high`` is None)."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not accepted; expected {expected}")
        return value

    return parse


def number(low: float, high: float | None = None, *, low_open: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number above ``low`` (or at it, ``low_open=False``), at
    most ``high``."""
    expected = f"a finite number {'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{text!r} is not accepted; expected {expected}")
        return value

    return parse
