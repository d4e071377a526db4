"""PowerSGD on the simulated world: the paper's algorithm matrix by matrix, exactness at
full rank, bytes per step."""

from __future__ import annotations

import pytest
import torch
from lowrank_helpers import (
    SHAPES,
    buckets,
    error_of,
    grads,
    one_thread,  # noqa: F401  (autouse: one thread for tiny LAPACK calls)
    reduce_step,
    reference,
    run,
    seeded_state,
)

from commpress.comm import SimulatedWorld
from commpress.compressors import build
from commpress.compressors.lowrank_plan import LowRankPlan


@pytest.mark.parametrize("world", [1, 3, 6])
def test_matches_per_matrix_reference(world):
    rank = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("powersgd", {"rank": rank}))
    bs = buckets(grads(world, seed=1))
    states = seeded_state(comps, bs[0], rank)
    expected, errors = reference("powersgd", bs, states, rank)
    reduce_step(sim, comps, bs)
    # float32 batched products against a float64 per-matrix loop over values of size ~1-10:
    # a few float32 ulps of the sums (2^-23 * 10 * world) stay far below 1e-4.
    for b, comp, err in zip(bs, comps, errors):
        torch.testing.assert_close(b.buffer.double(), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(error_of(comp, b).double(), err, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("world", [2, 5])
def test_exact_when_rank_covers_the_smaller_side(world):
    shapes = [(6, 40), (40, 6), (5,), (7, 3, 2), (6, 40)]  # wide, tall, 1-D, 3-D (7 x 6)
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("powersgd", {"rank": 7, "min_compression_rate": 0.0}))
    for step in range(3):
        bs = buckets(grads(world, seed=step, shapes=shapes), names=[f"w{i}" for i in range(len(shapes))])
        mean = torch.stack([b.buffer for b in bs]).mean(0)
        reduce_step(sim, comps, bs, step)
        # a full-rank projection is the identity up to float32 rounding of values ~1-3
        torch.testing.assert_close(bs[0].buffer, mean, atol=1e-5, rtol=1e-5)
        # each rank keeps M_i - mean(M): local deviations that cancel in the average
        assert torch.stack([error_of(c, b) for c, b in zip(comps, bs)]).mean(0).abs().max() < 1e-5


@pytest.mark.parametrize("rank", [1, 2])
def test_bytes_per_step_match_the_formula(rank):
    world, steps = 3, 4
    _comps, bs, sim = run("powersgd", {"rank": rank}, world, steps)
    plan = LowRankPlan.build(tuple(bs[0].slots), rank, 2.0)
    assert plan.batches  # the layout does compress something
    factors = sum(b.count * b.rank * (b.n + b.m) for b in plan.batches)
    for traffic in sim.traffic:
        assert traffic.bytes_sent == steps * 4 * (factors + plan.dense_numel)
        assert traffic.collectives == 2 * steps  # P with the dense part, then Q
    dense = sum(torch.Size(s).numel() for s in SHAPES if len(s) == 1) + 4  # the 2 x 2 matrix stays dense
    assert plan.dense_numel == dense


def test_only_one_round_without_matrices():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("powersgd"))
    bs = buckets(grads(2, 0, shapes=[(5,), (3,)]))
    mean = torch.stack([b.buffer for b in bs]).mean(0)
    sim.reduce(comps, bs)
    torch.testing.assert_close(bs[1].buffer, mean)
    assert sim.traffic[0].collectives == 1 and sim.traffic[0].bytes_sent == 4 * 8
