"""1-bit sign codes with one float32 scale per tensor (the ``onebit`` compressor), over a bucket's spans.

Encode, per span of a flat buffer: ``a = x`` (with error feedback ``x + error`` in float32, also
stored in ``acc``); one bit per element, 1 where ``a < 0`` (+0, -0 and NaN count as +), packed like
:func:`commpress.kernels.pack_bits`, spans end to end; the scale ``float32(sum|a| / n)``, the
float64 sum in :func:`commpress.kernels.span_stats`' order (NaN where the span holds a NaN, +Inf
where it holds an Inf, 0 when empty). Decode: ``out`` = the float32 sum of ``+-scale_r`` in rank
order, / world if > 1; with ``residual``, this rank's own value is subtracted from it in the same
pass (the error feedback ``a - scale * sign(a)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _checks
from .cuda import _launch

__all__ = ["sign_pack_many", "sign_unpack_accumulate_many"]


def sign_pack_many(
    x: torch.Tensor, spans: Sequence[tuple[int, int]], error: torch.Tensor | None = None, acc: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed signs (uint8) and scales (float32[T]) of every span of flat ``x``; with ``error`` and
    ``acc`` (float32; ``acc`` may be ``error``), ``acc``'s spans receive ``x + error``, which is encoded."""
    offsets, lengths = _checks.check_bucket("x", x, spans)
    if (error is None) != (acc is None):
        raise ValueError("error and acc come together: pass both (error feedback) or neither")
    if error is not None:
        for name, t in (("error", error), ("acc", acc)):
            _checks.check_dtype(name, t, torch.float32)
            if t.shape != x.shape or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous buffer of x's {x.numel()} elements, got shape {tuple(t.shape)}")
        _checks.check_same_device(x=x, error=error, acc=acc)
    numel = np.maximum(lengths, 1).astype(np.float64)
    if x.is_cuda:  # a device tensor divisor: IEEE quotients (torch multiplies by the reciprocal of a CPU scalar)
        packed, totals = _launch.sign_pack(x, offsets, lengths, error, acc)
        return packed, (totals / torch.from_numpy(numel).to(x.device)).to(torch.float32)
    from .cpu import sign as cpu

    packed, totals = cpu.sign_pack(x, offsets, lengths, error, acc)
    scales = torch.empty(lengths.size, dtype=torch.float32)  # (from_numpy of an empty quotient may have stride 0)
    scales.numpy()[:] = totals / numel
    return packed, scales


def sign_unpack_accumulate_many(
    packed: torch.Tensor,
    scales: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    rank: int = 0,
) -> torch.Tensor:
    """Decode every rank's :func:`sign_pack_many` payload into ``out`` inside the spans; with ``residual``
    (usually the encoding's ``acc``) subtract ``rank``'s own decoded values from it. Returns ``out``."""
    offsets, lengths, world = _checks.check_gathered(packed, scales, spans, out)
    _checks.check_shape("packed", packed, (world, int(((lengths + 7) // 8).sum())))
    _checks.check_shape("scales", scales, (world, len(offsets)))
    _checks.check_count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank={rank} is not one of the {world} ranks of packed")
    _checks.check_same_device(packed=packed, scales=scales, out=out)
    if residual is not None:
        _checks.check_dtype("residual", residual, torch.float32)
        if residual.shape != out.shape or not residual.is_contiguous():
            raise ValueError(f"residual must be a contiguous buffer of out's {out.numel()} elements, got {tuple(residual.shape)}")
        _checks.check_same_device(out=out, residual=residual)
    packed, scales = packed.contiguous(), scales.contiguous()
    if out.is_cuda:
        return _launch.sign_decode(packed, scales, offsets, lengths, out, residual, rank)
    from .cpu import sign as cpu

    cpu.sign_unpack_accumulate(packed, scales, offsets, lengths, out, residual, rank)
    return out
