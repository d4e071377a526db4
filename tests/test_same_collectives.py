"""Every method issues its peers' collectives whatever its own state: what a step sends
depends on the config, the bucket and the step number only (or on sizes the ranks agree on
first). A replica healing under a torchft Manager runs its step before its peers' state
reaches it, with empty state; a collective of another size there aborts gloo on every
rank (ACP-SGD once chose P or Q by its own count of steps)."""

from __future__ import annotations

import pytest
from lowrank_helpers import buckets, grads, reduce_step
from test_compressor_wire import CASES

from commpress.comm import SimulatedWorld
from commpress.compressors import build

EXTRA = [("terngrad", {"entropy": True}), ("acpsgd", {"rank": 1})]


@pytest.mark.parametrize(("method", "params"), CASES + EXTRA)
@pytest.mark.parametrize("done", [1, 2, 3])
def test_a_rank_with_empty_state_issues_its_peers_collectives(method, params, done):
    world = 3
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, params))
    for step in range(done):
        reduce_step(sim, comps, buckets(grads(world, step)), step)
    comps[1] = build(method, params)  # a healing replica: its peers' state has not reached it
    sent = [t.bytes_sent for t in sim.traffic]
    # SimulatedWorld raises on collectives that differ across ranks in kind, op or shape
    reduce_step(sim, comps, buckets(grads(world, done)), done)
    after = [t.bytes_sent - s for t, s in zip(sim.traffic, sent)]
    assert after[0] > 0 and len(set(after)) == 1, after


def test_acpsgd_at_an_odd_step_sends_q_without_a_p_of_its_own():
    """A fresh ACP-SGD at an odd step sends Q from the step's shared random P: the same
    draw on every rank, so a fresh world agrees with itself bit for bit."""
    world = 2
    results = []
    for _ in range(2):
        sim = SimulatedWorld(world)
        comps = sim.compressors(lambda: build("acpsgd", {"rank": 2}))
        bs = buckets(grads(world, 5))
        reduce_step(sim, comps, bs, step=1)
        results.append((bs[0].buffer.clone(), comps[0].state_dict()))
    (first, state), (again, _) = results
    assert state["q"] and not state["p"]  # a Q step stages Q
    assert first.equal(again)
