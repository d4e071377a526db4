"""Names and seeds for the random choices of compressors, per tensor.

A seed depends on the parameter's *name*, not its bucket or position, so a tensor's random bits
survive DDP's bucket rebuilds and resumes: runs are reproducible whatever the bucketing.

:func:`shared_normal` draws the low-rank methods' shared random factors on the gradient's device
with integer torch operations (SplitMix64, as :mod:`commpress.kernels.rng`), so every rank gets
the same numbers without communication or host transfer.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from typing import Annotated

import torch

from commpress.compressors.base import Bucket, ParamSlot
from commpress.kernels import derive_seed
from commpress.kernels.rng import GAMMA, MIX1, MIX2, derive_seeds
from commpress.schema import Bounds

__all__ = ["Seed", "shared_normal", "stream_starts", "tensor_key", "tensor_seeds"]

#: A compressor's ``seed`` parameter: a 63-bit non-negative integer (mixed into a 64-bit key).
Seed = Annotated[int, Bounds(ge=0, lt=2**63)]


def tensor_key(bucket: Bucket, slot: ParamSlot) -> str:
    """What identifies a tensor across steps and bucket layouts: its parameter name (an unnamed
    bucket's single "flat" slot is named after the bucket)."""
    return f"flat{bucket.index}" if slot.name == "flat" else slot.name


def tensor_seeds(seed: int, rank: int, step: int, bucket: Bucket, slots: Sequence[ParamSlot]) -> list[int]:
    """Each tensor's random key, ``derive_seed(seed, rank, step, crc32(tensor_key))``."""
    return derive_seeds((seed, rank, step), [_crc(tensor_key(bucket, s)) for s in slots])


@functools.lru_cache(maxsize=1 << 16)
def _crc(name: str) -> int:
    """A tensor name's CRC-32 (names repeat every step)."""
    return zlib.crc32(name.encode())


def _signed(v: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def stream_starts(seed: int, pieces: Sequence[tuple[str, int]], device: torch.device) -> torch.Tensor:
    """int64 SplitMix64 counters of consecutive pieces (name, numel): ``key(seed, name) + j * GAMMA``."""
    parts = [
        torch.arange(numel, dtype=torch.int64, device=device).mul_(_signed(GAMMA)).add_(_signed(derive_seed(seed, _crc(name))))
        for name, numel in pieces
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on every element of int64 ``z`` (two's-complement wrap)."""
    z = z ^ _shift(z, 30)
    z = z * _signed(MIX1)
    z = z ^ _shift(z, 27)
    z = z * _signed(MIX2)
    return z ^ _shift(z, 31)


def shared_normal(starts: torch.Tensor, draw: int) -> torch.Tensor:
    """Standard normal float32 numbers per counter of :func:`stream_starts` for ``draw`` (the step),
    by Box-Muller on two 23-bit fields of one 64-bit word."""
    z = mix64(starts + _signed(derive_seed(draw)))
    scale = 2.0**-23
    u1 = _shift(z, 41).to(torch.float32).add_(0.5).mul_(scale)  # (0, 1): the log is finite
    u2 = (_shift(z, 18) & ((1 << 23) - 1)).to(torch.float32).mul_(scale)
    return u1.log_().mul_(-2.0).sqrt_().mul_(torch.cos(u2.mul_(2 * math.pi)))
