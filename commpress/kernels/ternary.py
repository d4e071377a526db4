"""TernGrad's stochastic ternary quantization: 2-bit codes, one float32 scale per tensor.

Code 0 is 0, code 1 is +scale, code 2 is -scale (code 3 decodes to 0). Element ``i`` is kept
when ``u_i < |x_i| / scale`` with ``u = uniform(seed, n)``, so its expected decoded value is
``x_i`` whenever ``|x_i| <= scale``. Both sides of the comparison are exact float32 values
(one IEEE division), so the CUDA kernel makes the same decision bit for bit. NaN elements,
and every element when ``scale`` is 0, NaN or negative, get code 0.

With a clip ``bound``, ``x`` is first clamped to ``[-bound, bound]`` in float32 (TernGrad's
gradient clipping): fused into the CPU pass as ``min(|x|, bound)``, a ``torch.clamp`` before
the CUDA kernel. Clamping is exact, so the bits agree.
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
    """Stochastic ternary codes of ``x`` (flattened), packed four per byte: ``uint8[ceil(n/4)]``.

    ``scale`` is a float32 0-d tensor (usually ``x.abs().max()``); ``x`` may be float32,
    float16 or bfloat16 (computed in float32). ``bound`` (float32, one value, >= 0; checked
    on the CPU only, where reading it costs no device sync) clamps ``x`` to
    ``[-bound, bound]`` first.
    """
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
    x = x.contiguous()
    n = x.numel()
    out = torch.empty(packed_size(n, 2), dtype=torch.uint8)
    s = np.float32(scale.item())
    if not s > 0:
        return out.zero_()
    from .cpu import ternary as cpu

    cpu.ternary_quantize_pack(x, s, b, seed, out)
    return out


def _check_scalar(name: str, t: torch.Tensor) -> None:
    _checks.check_dtype(name, t, torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(t.shape)}")


def ternary_unpack_accumulate(packed: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """``out = sum_r scales[r] * decode(packed[r]) / world``, summed in rank order in float32.

    ``packed`` is ``uint8[world, ceil(n/4)]`` (every rank's payload), ``scales`` float32[world];
    ``out`` (float32, float16 or bfloat16, ``n`` elements) is overwritten and returned.
    """
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_dtype("scales", scales, torch.float32)
    _checks.check_float("out", out)
    _checks.check_count("n", n)
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [world, ceil(n/4)], got shape {tuple(packed.shape)}")
    world = packed.shape[0]
    _checks.check_shape("packed", packed, (world, packed_size(n, 2)))
    _checks.check_shape("scales", scales, (world,))
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")
    if world < 1:
        raise ValueError("packed must hold at least one rank")
    _checks.check_same_device(packed=packed, scales=scales, out=out)
    packed, scales = packed.contiguous(), scales.contiguous()
    if out.is_cuda:
        return _launch.ternary_unpack_accumulate(packed, scales, n, out)
    from .cpu import ternary as cpu

    cpu.ternary_unpack_accumulate(packed, scales, n, out)
    return out
