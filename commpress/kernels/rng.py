"""Counter-based random numbers that the CPU kernels and the CUDA kernels produce bit-identically.

Generator: SplitMix64 (Steele, Lea, Flood 2014; the generator of Java's SplittableRandom)
used in counter mode. For key ``seed`` (64 bits) word ``c`` is::

    z = seed + c * 0x9E3779B97F4A7C15            (mod 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)

and each 64-bit word gives two 32-bit draws: element ``i`` of the stream is the low
(``i`` even) or high (``i`` odd) half of word ``i // 2``. A uniform float is built from the
low 23 bits of its draw: ``u = (bits & 0x7FFFFF) * 2**-23`` in [0, 1), exact in float32.
A key is derived from integers by folding them in one at a time, starting from
``SEED_BASIS``: ``h = mix((h ^ v) + 0x9E3779B97F4A7C15)`` with ``mix`` the last three lines.

It is written once per runtime: compiled for the CPU (:mod:`commpress.kernels.cpu.rng`, which
also folds the keys), in CUDA (``cuda/common.cuh``) and in torch integer ops
(:func:`commpress.compressors.wire.seeding.mix64`, for the low-rank methods' shared factors); the
tests check the three against this definition.

Why not Philox4x32-10: it needs 32x32->64 multiplies over ten rounds, about 5x the work of
this one (three 64-bit multiplies for two draws) on a CPU, while on a GPU both are far
cheaper than the memory traffic around them. Integer-only arithmetic makes the CUDA port
exact by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._constants import GAMMA, MASK64, MIX1, MIX2, SEED_BASIS
from .cuda import _launch

__all__ = ["GAMMA", "MIX1", "MIX2", "derive_seed", "derive_seeds", "uniform"]


def derive_seed(*values: int) -> int:
    """Fold integers (user seed, rank, step, tensor index, ...) into one 64-bit key.

    Order matters and every value changes the result; ints are taken modulo 2**64 (so -1 and
    2**64 - 1 give the same key). Use a different key for every (rank, step, tensor).
    """
    from .cpu import rng

    return rng.fold_chain(SEED_BASIS, _words(values, "derive_seed"))


def derive_seeds(prefix: Sequence[int], last: Sequence[int]) -> list[int]:
    """``[derive_seed(*prefix, v) for v in last]``, folding the common ``prefix`` once (a
    key per tensor of a bucket: same user seed, rank and step, a different tensor)."""
    from .cpu import rng

    return rng.fold_each(derive_seed(*prefix), _words(last, "derive_seeds"))


def _words(values: Sequence[int], caller: str) -> list[int]:
    """``values`` modulo 2**64; TypeError unless every one is an int."""
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int)), None)
    if bad is not None:
        raise TypeError(f"{caller} takes ints, got {type(bad).__name__}")
    return [v & MASK64 for v in values]


def check_seed(seed: int) -> int:
    """``seed`` modulo 2**64; TypeError unless it is an int."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return seed & MASK64


def uniform(seed: int, n: int, offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1): element ``i`` is draw ``offset + i`` of stream ``seed``.

    The same (seed, offset) gives the same bits on every device.
    """
    seed = check_seed(seed)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be an integer >= 0")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset={offset!r} must be an integer >= 0")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return _launch.uniform(seed, n, offset, device)
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported; accepted: cpu, cuda")
    from .cpu import rng

    out = torch.empty(n, dtype=torch.float32)
    rng.fill_uniform_tensor(out, seed, offset)
    return out
