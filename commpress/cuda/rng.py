"""Counter-based random numbers that the CPU path and the CUDA kernels produce bit-identically.

Generator: SplitMix64 (Steele, Lea, Flood 2014; the generator of Java's SplittableRandom)
used in counter mode. For key ``seed`` (64 bits) word ``c`` is::

    z = seed + c * 0x9E3779B97F4A7C15            (mod 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)

and each 64-bit word gives two 32-bit draws: element ``i`` of the stream is the low
(``i`` even) or high (``i`` odd) half of word ``i // 2``. A uniform float is built from the
low 23 bits of its draw: ``u = (bits & 0x7FFFFF) * 2**-23`` in [0, 1), exact in float32.

Why not Philox4x32-10: it needs 32x32->64 multiplies over ten rounds; in vectorized numpy
that is about 5x slower than this one (three 64-bit multiplies for two draws), while on a
GPU both are far cheaper than the memory traffic around them. Integer-only arithmetic
makes the CUDA port exact by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _backend, _chunks
from ._constants import GAMMA, MASK64, MIX1, MIX2, SEED_BASIS

__all__ = ["derive_seed", "derive_seeds", "uniform"]

_U64 = np.uint64
_BASE = np.arange(_chunks.CHUNK // 2 + 1, dtype=np.uint64) * _U64(GAMMA)  # c * GAMMA for one block


def mix64(z: int) -> int:
    """SplitMix64's output function on a Python int (the reference for the vectorized form)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def derive_seed(*values: int) -> int:
    """Fold integers (user seed, rank, step, tensor index, ...) into one 64-bit key.

    Order matters and every value changes the result; ints are taken modulo 2**64 (so -1 and
    2**64 - 1 give the same key). Use a different key for every (rank, step, tensor).
    """
    h = SEED_BASIS
    for v in values:
        h = _fold(h, v, "derive_seed")
    return h


def derive_seeds(prefix: Sequence[int], last: Sequence[int]) -> list[int]:
    """``[derive_seed(*prefix, v) for v in last]``, folding the common ``prefix`` once (a
    key per tensor of a bucket: same user seed, rank and step, a different tensor)."""
    h = derive_seed(*prefix)
    return [_fold(h, v, "derive_seeds") for v in last]


def _fold(h: int, v: int, caller: str) -> int:
    """One step of :func:`derive_seed`: the key so far ``h`` with the int ``v`` folded in."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{caller} takes ints, got {type(v).__name__}")
    return mix64(((h ^ (v & MASK64)) + GAMMA) & MASK64)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return seed & MASK64


def words(seed: int, first: int, count: int) -> np.ndarray:
    """SplitMix64 words ``first .. first + count - 1`` of stream ``seed`` as uint64."""
    start = _U64((seed + first * GAMMA) & MASK64)
    if count <= _BASE.size:
        z = np.add(_BASE[:count], start)
    else:
        z = np.arange(count, dtype=np.uint64)
        z *= _U64(GAMMA)
        z += start
    t = np.empty_like(z)
    np.right_shift(z, _U64(30), out=t)
    z ^= t
    z *= _U64(MIX1)
    np.right_shift(z, _U64(27), out=t)
    z ^= t
    z *= _U64(MIX2)
    np.right_shift(z, _U64(31), out=t)
    z ^= t
    return z


def bits32(seed: int, count: int, offset: int = 0) -> np.ndarray:
    """Draws ``offset .. offset + count - 1`` (uint32) of stream ``seed``."""
    skip = offset & 1
    z = words(seed, offset >> 1, (skip + count + 1) >> 1)
    return z.view(np.uint32)[skip : skip + count]


def fill_uniform(out: np.ndarray, seed: int, offset: int) -> None:
    """Write uniforms ``offset .. offset + out.size - 1`` of stream ``seed`` into float32 ``out``."""
    skip = offset & 1
    z = words(seed, offset >> 1, (skip + out.size + 1) >> 1)
    w = z.view(np.uint32)
    w &= np.uint32(0x7FFFFF)
    w |= np.uint32(0x3F800000)  # 1.0f: the float in [1, 2) whose mantissa holds the 23 bits
    np.subtract(w.view(np.float32)[skip : skip + out.size], np.float32(1.0), out=out)


def uniform(seed: int, n: int, offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1): element ``i`` is draw ``offset + i`` of stream ``seed``.

    The same (seed, offset) gives the same bits on every device.
    """
    seed = _check_seed(seed)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be an integer >= 0")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset={offset!r} must be an integer >= 0")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        from . import _launch

        return _launch.uniform(seed, n, offset, device)
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported; accepted: cpu, cuda")
    out = torch.empty(n, dtype=torch.float32)
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.fill_uniform_tensor(out, seed, offset)
        return out
    out_np = _chunks.as_numpy(out)
    _chunks.run(n, lambda s, e: fill_uniform(out_np[s:e], seed, offset + s))
    return out
