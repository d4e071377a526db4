"""b-bit uniform quantization with stochastic rounding, one (min, scale) per bucket of B elements.

For bucket ``j`` with ``lo = min``, ``hi = max`` (each plus 0.0, so a zero is always +0) and
``scale = (hi - lo) / (2**b - 1)``, element ``i`` gets code
``q = floor((x_i - lo) / scale + u_i)`` clamped to ``[0, 2**b - 1]``, with ``u = uniform(seed,
n)``; so ``E[lo + q * scale] = x_i`` (unbiased). A NaN ``q`` (NaN in the bucket, or ``0 / 0``)
becomes 0, and a bucket whose scale is 0 gets all-zero codes. Every step is one IEEE float32
operation (no fused multiply-add), which the CUDA kernels repeat exactly.

Decoding is ``lo + q * scale`` (multiply, then add); the accumulating decode sums the ranks in
rank order in float32 and divides by the number of ranks.
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
    """Quantize flat ``x`` to ``bits``-bit codes per bucket of ``bucket_size``; pack them.

    Returns ``(packed uint8[ceil(n*bits/8)], mins float32[nb], scales float32[nb])`` with
    ``nb = ceil(n / bucket_size)``. ``x`` may be float32, float16 or bfloat16.
    """
    _checks.check_float("x", x)
    _check_layout(bits, bucket_size)
    seed = check_seed(seed)
    x = x.reshape(-1)
    if x.is_cuda:
        return _launch.quantize_pack(x, bits, bucket_size, seed)
    from .cpu import quantize

    x = x.contiguous()
    n = x.numel()
    nb = -(-n // bucket_size)
    packed = torch.empty(packed_size(n, bits), dtype=torch.uint8)
    mins = torch.empty(nb, dtype=torch.float32)
    scales = torch.empty(nb, dtype=torch.float32)
    quantize.quantize_pack(x, bits, bucket_size, seed, packed, mins, scales)
    return packed, mins, scales


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


def _check_out(out: torch.Tensor, n: int) -> None:
    _checks.check_float("out", out)
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")


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
    _check_out(out, n)
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
    """``out = sum_r decode(rank r) (/ world)``, summed in rank order in float32; returns ``out``.

    ``packed`` uint8[world, ceil(n*bits/8)], ``mins``/``scales`` float32[world, nb]; ``out``
    (float32/float16/bfloat16, ``n`` elements) is overwritten.
    """
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [world, bytes], got shape {tuple(packed.shape)}")
    world = packed.shape[0]
    if world < 1:
        raise ValueError("packed must hold at least one rank")
    _check_payload(packed, mins, scales, bits, bucket_size, n, world)
    _check_out(out, n)
    _checks.check_same_device(packed=packed, mins=mins, scales=scales, out=out)
    packed, mins, scales = packed.contiguous(), mins.contiguous(), scales.contiguous()
    if out.is_cuda:
        return _launch.unpack_accumulate(packed, mins, scales, bits, bucket_size, n, out, average)
    from .cpu import quantize

    quantize.unpack_accumulate(packed, mins, scales, bits, bucket_size, n, out, average)
    return out
