"""Chunked execution of the CPU paths.

Each CPU op runs a short sequence of numpy ufuncs over blocks of ``CHUNK`` elements, so the
intermediates stay in the L2 cache instead of streaming through memory once per step. numpy
(not torch) because its ufuncs have uint64 logical shifts and a few microseconds less
overhead per call, which dominates at this block size.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import numpy as np
import torch

if sys.byteorder != "little":  # the bit packing reinterprets bytes as little-endian words
    raise ImportError("commpress.cuda CPU paths need a little-endian machine")

# Elements per block: a multiple of 8 (whole bytes for every bit width); 64 Ki elements
# keep every intermediate of an fp32 block (<= 512 KiB) inside a 2 MiB L2 cache.
CHUNK = 1 << 16


def spans(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` covering ``range(n)`` in blocks of ``chunk``."""
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor (bfloat16 is not viewable)."""
    return t.detach().numpy()


def float32_block(x: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """``x[start:stop]`` as a float32 numpy array: a view for float32, a converted copy otherwise."""
    block = x[start:stop]
    if block.dtype != torch.float32:
        block = block.float()
    return as_numpy(block)


def write_block(out: torch.Tensor, start: int, values: np.ndarray) -> None:
    """Store float32 ``values`` into ``out[start:...]``, rounding to out's dtype (nearest-even)."""
    dst = out[start : start + values.size]
    if dst.dtype == torch.float32:
        as_numpy(dst)[...] = values
    else:
        dst.copy_(torch.from_numpy(values))


def run(n: int, body: Callable[[int, int], None], chunk: int = CHUNK) -> None:
    """Call ``body(start, stop)`` for every block of ``range(n)``."""
    for start, stop in spans(n, chunk):
        body(start, stop)
