"""TernGrad over all tensors of a bucket in one call: the per-tensor ops of :mod:`.ternary`, batched.

A bucket holds many small tensors (biases, norms), for which a call each costs more than its work;
these give the per-tensor ops' bits for every ``(offset, numel)`` span in one compiled CPU pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _checks
from ._constants import packed_size
from .rng import check_seed
from .ternary import ternary_quantize_pack, ternary_unpack_accumulate

__all__ = ["ternary_quantize_pack_many", "ternary_unpack_accumulate_many"]


def ternary_quantize_pack_many(
    x: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    scales: torch.Tensor,
    seeds: Sequence[int],
    bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.cat([ternary_quantize_pack(x[o:o+n], scales[t], seeds[t], bounds[t]) for t, (o, n) ...])``
    for flat ``x``; ``bounds`` (>= 0, inf: no clipping) may be None."""
    offsets, lengths = _checks.check_bucket("x", x, spans)
    count = len(offsets)
    _checks.check_dtype("scales", scales, torch.float32)
    _checks.check_shape("scales", scales, (count,))
    if len(seeds) != count:
        raise ValueError(f"seeds has {len(seeds)} entries for {count} spans")
    seeds = [check_seed(s) for s in seeds]
    if bounds is not None:
        _checks.check_dtype("bounds", bounds, torch.float32)
        _checks.check_shape("bounds", bounds, (count,))
        _checks.check_same_device(x=x, scales=scales, bounds=bounds)
    _checks.check_same_device(x=x, scales=scales)
    if x.is_cuda:
        scale, bound = scales.unbind(), [None] * count if bounds is None else bounds.unbind()
        pieces = [
            ternary_quantize_pack(x.narrow(0, o, n), scale[t], seeds[t], bound[t])
            for t, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist()))
        ]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=x.device)
    bound = np.full(count, np.inf, np.float32) if bounds is None else bounds.contiguous().numpy()
    if not (bound >= 0).all():
        raise ValueError(f"bounds must be numbers >= 0 (inf: no clipping), got {bound[~(bound >= 0)].tolist()}")
    scale = scales.contiguous().numpy()
    from .cpu import ternary as cpu

    return cpu.ternary_quantize_pack_many(x, offsets, lengths, scale, bound, np.array(seeds, dtype=np.uint64))


def ternary_unpack_accumulate_many(
    packed: torch.Tensor, scales: torch.Tensor, spans: Sequence[tuple[int, int]], out: torch.Tensor
) -> torch.Tensor:
    """:func:`ternary_unpack_accumulate` of every span ``(o, n)`` into ``out[o:o+n]``, each rank's row of
    ``packed`` holding the spans' payloads end to end; ``out`` is written inside the spans and returned."""
    offsets, lengths, world = _checks.check_gathered(packed, scales, spans, out)
    nbytes = [packed_size(int(n), 2) for n in lengths]
    _checks.check_shape("packed", packed, (world, sum(nbytes)))
    _checks.check_shape("scales", scales, (world, len(offsets)))
    _checks.check_same_device(packed=packed, scales=scales, out=out)
    if out.is_cuda:
        # per tensor: every rank's bytes and scale, stacked dense (as the kernel reads them)
        rows = [row.split(nbytes) for row in packed.unbind(0)]
        per_rank_scales = [row.unbind() for row in scales.unbind(0)]
        for t, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            payloads = torch.stack([pieces[t] for pieces in rows])
            scale = torch.stack([row[t] for row in per_rank_scales])
            ternary_unpack_accumulate(payloads, scale, n, out.narrow(0, o, n))
        return out
    from .cpu import ternary as cpu

    cpu.ternary_unpack_accumulate_many(packed.contiguous(), scales, offsets, lengths, out)
    return out
