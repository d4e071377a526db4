"""Counter-based random numbers that the CPU and CUDA kernels produce bit-identically.

SplitMix64 (Steele, Lea, Flood 2014) in counter mode; for the 64-bit key ``seed`` word ``c`` is::

    z = seed + c * 0x9E3779B97F4A7C15            (mod 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)

Draw ``i`` is the low (``i`` even) or high half of word ``i // 2``; its uniform is
``(draw & 0x7FFFFF) * 2**-23`` in [0, 1), exact in float32. A key folds integers into
``SEED_BASIS`` one at a time: ``h = mix((h ^ v) + 0x9E3779B97F4A7C15)``, ``mix`` the last three
lines. Written for the CPU (:mod:`commpress.kernels.cpu.rng`), in CUDA (``cuda/common.cuh``) and in
torch ops (:func:`commpress.compressors.wire.seeding.mix64`), all tested against this definition.
Not Philox4x32-10: its ten rounds of multiplies cost far more on a CPU; integer-only arithmetic
keeps the CUDA port exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks
from ._constants import GAMMA, MASK64, MIX1, MIX2, SEED_BASIS
from .cuda import _launch

__all__ = ["GAMMA", "MIX1", "MIX2", "derive_seed", "derive_seeds", "uniform"]


def derive_seed(*values: int) -> int:
    """Fold integers (user seed, rank, step, tensor index, ...), in order and modulo 2**64, into
    one 64-bit key; use a different key for every (rank, step, tensor)."""
    from .cpu import rng

    return rng.fold_chain(SEED_BASIS, _words(values, "derive_seed"))


def derive_seeds(prefix: Sequence[int], last: Sequence[int]) -> list[int]:
    """``[derive_seed(*prefix, v) for v in last]``, folding the shared ``prefix`` once (a key per tensor)."""
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
    """``n`` float32 uniforms in [0, 1), draws ``offset ..`` of stream ``seed``; the same bits on every device."""
    seed = check_seed(seed)
    _checks.check_count("n", n)
    _checks.check_count("offset", offset)
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return _launch.uniform(seed, n, offset, device)
    if device.type != "cpu":
        raise ValueError(f"device={device} is not supported; accepted: cpu, cuda")
    from .cpu import rng

    out = torch.empty(n, dtype=torch.float32)
    rng.fill_uniform_tensor(out, seed, offset)
    return out
