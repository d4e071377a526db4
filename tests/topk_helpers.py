"""Shared pieces of the Top-k tests (tests/test_topk.py and tests/test_topk_values.py):
the tensor layout every test reduces, seeded gradients, buckets, one committed step on the
simulated world, a compressor's residuals read back by parameter name, and a run resumed
from a checkpoint beside the same run straight through. They keep the
leading underscore they had as private helpers of one file, so the moved tests read as before."""

from __future__ import annotations

import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Compressor, build

SIZES = (300, 40, 7, 1)
NAMES = ("w", "b", "c", "d")
ALL = {"min_numel": 0}  # every tensor sparsified, however small (the small-tensor rule has its own tests in test_topk.py)


def _grads(seed: int, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def _bucket(grads, index: int = 0, names=NAMES, dtype=torch.float32) -> Bucket:
    return Bucket.from_tensors(index, [t.to(dtype) for t in grads], list(names)[: len(grads)])


def _step(sim: SimulatedWorld, comps, buckets, step: int = 0) -> None:
    """One training step of one bucket per rank: reduce, then commit the staged residuals."""
    sim.reduce(comps, buckets, step)
    for c in comps:
        c.end_step(True)


def _residual(comp, names=NAMES) -> torch.Tensor:
    res = comp.state_dict()["residuals"]
    return torch.cat([res[n] for n in names if n in res])


def _straight_and_resumed(params: dict) -> tuple[Compressor, list[torch.Tensor], list[torch.Tensor]]:
    """Steps 3-5 of one Top-k run straight through, and the same steps by a fresh compressor
    loaded with the state saved after step 2: (that compressor, straight outputs, resumed ones)."""

    def run(steps, comp=None):
        sim = SimulatedWorld(1)
        comp = comp or build("topk", params)
        outs = []
        for step in steps:
            b = _bucket(_grads(step))
            _step(sim, [comp], [b], step=step)
            outs.append(b.buffer)
        return comp, outs

    _, straight = run(range(6))
    first, _ = run(range(3))
    fresh = build("topk", params)
    fresh.load_state_dict(first.state_dict())
    _, resumed = run(range(3, 6), fresh)
    return fresh, straight[3:], resumed
