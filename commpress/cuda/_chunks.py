"""Chunked execution of the CPU paths.

Each CPU op runs a short sequence of numpy ufuncs over blocks of ``CHUNK`` elements, so the
intermediates stay in the L2 cache instead of streaming through memory once per step. numpy
(not torch) because its ufuncs have uint64 logical shifts and a few microseconds less
overhead per call, which dominates at this block size.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

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


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)


def _executor() -> ThreadPoolExecutor | None:
    """A pool of ``torch.get_num_threads()`` workers (None for one), re-created after a fork."""
    global _pool
    workers = torch.get_num_threads()
    if workers <= 1:
        return None
    if _pool is None or _pool[0] != os.getpid() or _pool[1] != workers:
        _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="commpress-cpu"))
    return _pool[2]


def map_blocks(body: Callable[[int, int], object], blocks: list[tuple[int, int]]) -> list:
    """``[body(start, stop) for each block]``, spread over torch's intra-op thread count.

    numpy releases the GIL inside each ufunc, so blocks run in parallel; the bodies write
    disjoint slices of their outputs.
    """
    pool = _executor() if len(blocks) > 1 else None
    if pool is None:
        return [body(start, stop) for start, stop in blocks]
    return list(pool.map(lambda block: body(*block), blocks))


def run(n: int, body: Callable[[int, int], None], chunk: int = CHUNK) -> None:
    """Call ``body(start, stop)`` for every block of ``range(n)`` (in parallel, see map_blocks)."""
    map_blocks(body, list(spans(n, chunk)))
