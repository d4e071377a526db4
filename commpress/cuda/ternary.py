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

from . import _backend, _checks, _chunks, bitpack, rng

__all__ = ["ternary_quantize_pack", "ternary_unpack_accumulate"]


def _codes_np(x: np.ndarray, scale: np.float32, bound: np.float32, seed: int, offset: int, codes: np.ndarray) -> None:
    """Ternary codes of float32 block ``x`` (stream position ``offset``) into uint8 ``codes``."""
    u = np.empty(x.size, np.float32)
    rng.fill_uniform(u, seed, offset)
    p = np.abs(x)
    np.minimum(p, bound, out=p)  # NaN stays NaN (never kept)
    np.divide(p, scale, out=p)
    keep = np.less(u, p)
    neg = np.signbit(x)
    np.left_shift(keep.view(np.uint8), neg.view(np.uint8), out=codes)  # 1 << sign: 1 or 2


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
    seed = rng._check_seed(seed)
    x = x.reshape(-1)
    if x.is_cuda:
        from . import _launch

        if bound is not None:
            x = torch.clamp(x.float(), -bound.reshape(()), bound.reshape(()))
        return _launch.ternary_quantize_pack(x, scale.reshape(()), seed)
    b = np.float32(np.inf if bound is None else bound.item())
    if not b >= 0:
        raise ValueError(f"bound must be a number >= 0 (inf: no clipping), got {float(b)}")
    x = x.contiguous()
    n = x.numel()
    out = torch.empty(bitpack.packed_size(n, 2), dtype=torch.uint8)
    s = np.float32(scale.item())
    if not s > 0:
        return out.zero_()
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.ternary_quantize_pack(x, s, b, seed, out)
        return out
    dst = _chunks.as_numpy(out)

    def body(start: int, stop: int) -> None:
        codes = np.empty(stop - start, np.uint8)
        _codes_np(_chunks.float32_block(x, start, stop), s, b, seed, start, codes)
        bitpack.pack_np(codes, 2, dst[start // 4 : bitpack.packed_size(stop, 2)])

    _chunks.run(n, body)
    return out


def _check_scalar(name: str, t: torch.Tensor) -> None:
    _checks.check_dtype(name, t, torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(t.shape)}")


def _decode_table(scale: float) -> np.ndarray:
    """float32[256, 4]: the four values a packed byte decodes to under ``scale``."""
    values = np.array([0.0, scale, -scale, 0.0], np.float32)
    byte = np.arange(256)
    return values[(byte[:, None] >> (2 * np.arange(4))) & 3]


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
    _checks.check_shape("packed", packed, (world, bitpack.packed_size(n, 2)))
    _checks.check_shape("scales", scales, (world,))
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")
    if world < 1:
        raise ValueError("packed must hold at least one rank")
    _checks.check_same_device(packed=packed, scales=scales, out=out)
    if out.is_cuda:
        from . import _launch

        return _launch.ternary_unpack_accumulate(packed.contiguous(), scales.contiguous(), n, out)
    packed, scales = packed.contiguous(), scales.contiguous()
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.ternary_unpack_accumulate(packed, scales, n, out)
        return out
    src = _chunks.as_numpy(packed)
    tables = [_decode_table(float(s)) for s in scales.tolist()]
    flat = out.view(-1)
    divisor = np.float32(world)

    def body(start: int, stop: int) -> None:
        lo, hi = start // 4, bitpack.packed_size(stop, 2)
        acc = np.take(tables[0], src[0, lo:hi], axis=0).reshape(-1)
        part = np.empty_like(acc)
        for r in range(1, world):
            np.take(tables[r], src[r, lo:hi], axis=0, out=part.reshape(-1, 4))
            acc += part
        if world > 1:
            acc /= divisor
        _chunks.write_block(flat, start, acc[: stop - start])

    _chunks.run(n, body)
    return out
