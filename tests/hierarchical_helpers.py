"""Shared pieces of the tests on 4 gloo ranks (tests/test_hierarchical.py,
tests/test_hierarchical_adaptive.py, tests/test_layerwise_bandwidth.py): the world size,
parameter slots from (name, shape) pairs, the small-integer gradients every rank reduces
(their sums are exact in float32, so results can be compared bit for bit) and one step of
them through a CommState. The helpers keep the leading underscore they had as
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


def _reduce_step(state, rank: int, step: int, buckets) -> list[torch.Tensor]:
    """One step as DDP runs it: every bucket's ``_grad`` reduced through ``state``, waited on,
    and the step's state committed (what the next step's first bucket does); the results."""
    futs, bufs = [], []
    for index, members in enumerate(buckets):
        buf = _grad(rank, step, index, sum(p.numel() for p in members))
        bufs.append(buf)
        futs.append(state.reduce(index, buf, members, advance=index == len(buckets) - 1))
    torch.futures.wait_all(futs)
    state.end_step()
    return [b.clone() for b in bufs]
