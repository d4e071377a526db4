"""Shared pieces of the tests on 4 gloo ranks (tests/test_hierarchical.py and
tests/test_hierarchical_adaptive.py): the world size, parameter slots from (name, shape)
pairs, and the small-integer gradients every rank reduces (their sums are exact in float32,
so results can be compared bit for bit). The helpers keep the leading underscore they had as
private helpers of one file, so the moved tests read as before."""

from __future__ import annotations

import torch

from commpress.compressors import ParamSlot

WORLD = 4


def _slots(spec) -> tuple[ParamSlot, ...]:
    out, offset = [], 0
    for name, shape in spec:
        out.append(ParamSlot(name, torch.Size(shape), offset))
        offset += out[-1].numel
    return tuple(out)


def _grad(rank: int, step: int, index: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
    return torch.randint(-8, 9, (n,), generator=g).float()
