"""What the compiled CPU kernels share: numba's decorators and the size of their scratch pieces.

Kernels release the GIL, are cached on disk and use numpy's error model. No fast-math (no
reassociation or fused multiply-add), so each step is the CUDA kernels' IEEE float32 operation.
Where no cache directory is writable (docs/kernels.md, "Where the compiled kernels are cached"),
they are compiled uncached in every process, with one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

__all__ = ["KEY_ABS", "NONE", "ONE", "PIECE", "UNCACHED", "ZERO", "inline", "jit"]

#: the kernels compiled without numba's disk cache (no cache directory was writable)
UNCACHED: list[str] = []
_OPTIONS = {"nogil": True, "error_model": "numpy"}


def _compiler(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """numba's ``njit`` with the shared options and the disk cache, or without it where numba finds none."""
    cached, plain = njit(cache=True, **_OPTIONS, **options), njit(**_OPTIONS, **options)

    def compile_(fn: Callable[..., Any]) -> Any:
        try:
            return cached(fn)
        except RuntimeError as exc:
            if "no locator available" not in str(exc):
                raise
            if not UNCACHED:
                warnings.warn(
                    f"numba finds no writable directory to cache commpress's CPU kernels in ({exc}): they are "
                    "compiled in every process, seconds each at registration; set NUMBA_CACHE_DIR to a writable "
                    "directory to keep them",
                    RuntimeWarning,
                    stacklevel=2,
                )
            UNCACHED.append(f"{fn.__module__}.{fn.__qualname__}")
            return plain(fn)

    return compile_


jit = _compiler()
inline = _compiler(inline="always")

PIECE = 4096  # elements per scratch piece (a multiple of 8: whole bytes at every bit width)
NONE = np.empty(0, np.float32)  # "no addend" for the kernels that may add one
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
KEY_ABS = np.uint32(0x7FFFFFFF)  # a float32's bits without the sign: its magnitude, ordered like the floats
