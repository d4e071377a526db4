"""ACP-SGD on the simulated world: both alternating steps against the paper's algorithm
matrix by matrix, and the alternating bytes per step."""

from __future__ import annotations

import pytest
import torch
from lowrank_helpers import (
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


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize(("step", "kind"), [(0, "acp_p"), (2, "acp_p"), (3, "acp_q")])
def test_matches_per_matrix_reference(world, step, kind):
    rank = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("acpsgd", {"rank": rank}))
    bs = buckets(grads(world, seed=2))
    states = seeded_state(comps, bs[0], rank)
    expected, errors = reference(kind, bs, states, rank)
    reduce_step(sim, comps, bs, step)
    # float32 batched products against a float64 per-matrix loop (see test_powersgd)
    for b, comp, err in zip(bs, comps, errors):
        torch.testing.assert_close(b.buffer.double(), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(error_of(comp, b).double(), err, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rank", [1, 2])
def test_bytes_alternate_between_p_and_q(rank):
    world = 3
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("acpsgd", {"rank": rank}))
    plan = None
    sent = []
    for step in range(4):
        bs = buckets(grads(world, step))
        plan = plan or LowRankPlan.build(tuple(bs[0].slots), rank, 2.0)
        before = sim.traffic[0].bytes_sent
        reduce_step(sim, comps, bs, step)
        sent.append(sim.traffic[0].bytes_sent - before)
    p_bytes = 4 * (sum(b.count * b.rank * b.n for b in plan.batches) + plan.dense_numel)
    q_bytes = 4 * (sum(b.count * b.rank * b.m for b in plan.batches) + plan.dense_numel)
    assert p_bytes != q_bytes
    assert sent == [p_bytes, q_bytes, p_bytes, q_bytes]
    assert all(t.collectives == 4 for t in sim.traffic)  # one all-reduce per step


def test_without_warm_start_every_step_is_a_p_step():
    world = 2
    _comps, bs, sim = run("acpsgd", {"rank": 2, "warm_start": False}, world, steps=3)
    plan = LowRankPlan.build(tuple(bs[0].slots), 2, 2.0)
    p_bytes = 4 * (sum(b.count * b.rank * b.n for b in plan.batches) + plan.dense_numel)
    assert sim.traffic[0].bytes_sent == 3 * p_bytes
