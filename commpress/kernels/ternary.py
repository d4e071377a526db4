"""TernGrad's stochastic ternary quantization: 2-bit codes, one float32 scale per tensor.

Codes 0, 1, 2 decode to 0, +scale, -scale (3 to 0). Element ``i`` is kept when
``u_i < |x_i| / scale`` (``u = uniform(seed, n)``), so its expected value is ``x_i`` where
``|x_i| <= scale``; both sides are exact float32 values, so CUDA decides the same bit for bit.
NaN elements, and all elements when ``scale`` is not > 0, get code 0. A clip ``bound`` first
clamps ``x`` to ``[-bound, bound]`` (TernGrad's gradient clipping; exact, so the bits agree).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks
from ._constants import packed_size
from .cuda import _launch
from .rng import check_seed

__all__ = ["ternary_quantize_pack", "ternary_unpack_accumulate"]


def ternary_quantize_pack(x: torch.Tensor, scale: torch.Tensor, seed: int, bound: torch.Tensor | None = None) -> torch.Tensor:
    """Ternary codes of flattened ``x``, four per byte. ``scale`` (usually ``x.abs().max()``) and ``bound``
    hold one float32 each; ``bound`` >= 0 is checked on the CPU only (no device sync)."""
    _checks.check_float("x", x)
    _check_scalar("scale", scale)
    _checks.check_same_device(x=x, scale=scale)
    if bound is not None:
        _check_scalar("bound", bound)
        _checks.check_same_device(x=x, bound=bound)
    seed = check_seed(seed)
    x = x.reshape(-1)
    if x.is_cuda:
        if bound is not None:
            x = torch.clamp(x.float(), -bound.reshape(()), bound.reshape(()))
        return _launch.ternary_quantize_pack(x, scale.reshape(()), seed)
    b = np.float32(np.inf if bound is None else bound.item())
    if not b >= 0:
        raise ValueError(f"bound must be a number >= 0 (inf: no clipping), got {float(b)}")
    out = torch.empty(packed_size(x.numel(), 2), dtype=torch.uint8)
    s = np.float32(scale.item())
    if not s > 0:
        return out.zero_()
    from .cpu import ternary as cpu

    cpu.ternary_quantize_pack(x.contiguous(), s, b, seed, out)
    return out


def _check_scalar(name: str, t: torch.Tensor) -> None:
    _checks.check_dtype(name, t, torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(t.shape)}")


def ternary_unpack_accumulate(packed: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """Overwrite ``out`` (``n`` elements) with ``sum_r scales[r] * decode(packed[r]) / world``,
    summed in rank order in float32; ``packed`` is uint8[world, ceil(n/4)]. Returns ``out``."""
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_dtype("scales", scales, torch.float32)
    _checks.check_count("n", n)
    _checks.check_out(out, n)
    world = _checks.check_world(packed)
    _checks.check_shape("packed", packed, (world, packed_size(n, 2)))
    _checks.check_shape("scales", scales, (world,))
    _checks.check_same_device(packed=packed, scales=scales, out=out)
    packed, scales = packed.contiguous(), scales.contiguous()
    if out.is_cuda:
        return _launch.ternary_unpack_accumulate(packed, scales, n, out)
    from .cpu import ternary as cpu

    cpu.ternary_unpack_accumulate(packed, scales, n, out)
    return out
