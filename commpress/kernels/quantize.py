"""b-bit uniform quantization with stochastic rounding, one (min, scale) per bucket of B elements.

Bucket ``j`` has ``lo = min + 0.0``, ``hi = max + 0.0`` (a zero is always +0) and
``scale = (hi - lo) / (2**b - 1)``. Element ``i`` gets ``q = floor((x_i - lo) / scale + u_i)``
clamped to ``[0, 2**b - 1]`` with ``u = uniform(seed, n)``, so ``E[lo + q * scale] = x_i``. A NaN
``q`` becomes 0; a bucket of scale 0 gets zero codes. Each step is one float32 operation, without
fused multiply-add. Decoding is ``lo + q * scale``; the ranks' decodes add up in rank order in float32.
"""

from __future__ import annotations

import torch

from . import _checks
from ._constants import packed_size
from .cuda import _launch
from .rng import check_seed

__all__ = ["dequantize", "quantize_pack", "unpack_accumulate"]

BITS = (2, 4, 8)


def _check_layout(bits: int, bucket_size: int) -> None:
    _checks.check_bits(bits, BITS)
    _checks.check_count("bucket_size", bucket_size, 1)


def quantize_pack(x: torch.Tensor, bits: int, bucket_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize flat ``x`` per bucket and pack the codes: ``(packed, mins, scales)``, packed as
    uint8[ceil(n*bits/8)], mins and scales as float32[ceil(n / bucket_size)]."""
    _checks.check_float("x", x)
    _check_layout(bits, bucket_size)
    seed = check_seed(seed)
    x = x.reshape(-1)
    if x.is_cuda:
        return _launch.quantize_pack(x, bits, bucket_size, seed)
    from .cpu import quantize

    return quantize.quantize_pack(x.contiguous(), bits, bucket_size, seed)


def _check_payload(packed, mins, scales, bits, bucket_size, n, world: int | None) -> None:
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_dtype("mins", mins, torch.float32)
    _checks.check_dtype("scales", scales, torch.float32)
    _check_layout(bits, bucket_size)
    _checks.check_count("n", n)
    lead = () if world is None else (world,)
    nb = -(-n // bucket_size)
    _checks.check_shape("packed", packed, (*lead, packed_size(n, bits)))
    _checks.check_shape("mins", mins, (*lead, nb))
    _checks.check_shape("scales", scales, (*lead, nb))


def dequantize(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    bucket_size: int,
    n: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one rank's payload: ``lo + q * scale`` per element, into ``out`` (float32 by default)."""
    _check_payload(packed, mins, scales, bits, bucket_size, n, None)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    return unpack_accumulate(
        packed.unsqueeze(0), mins.unsqueeze(0), scales.unsqueeze(0), bits, bucket_size, n, out, average=False
    )


def unpack_accumulate(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    bucket_size: int,
    n: int,
    out: torch.Tensor,
    average: bool = True,
) -> torch.Tensor:
    """Overwrite ``out`` (``n`` elements) with every rank's decode summed in rank order in float32
    (``/ world`` when ``average``); ``packed``, ``mins`` and ``scales`` have one row per rank."""
    world = _checks.check_world(packed)
    _check_payload(packed, mins, scales, bits, bucket_size, n, world)
    _checks.check_out(out, n)
    _checks.check_same_device(packed=packed, mins=mins, scales=scales, out=out)
    packed, mins, scales = packed.contiguous(), mins.contiguous(), scales.contiguous()
    if out.is_cuda:
        return _launch.unpack_accumulate(packed, mins, scales, bits, bucket_size, n, out, average)
    from .cpu import quantize

    quantize.unpack_accumulate(packed, mins, scales, bits, bucket_size, n, out, average)
    return out
