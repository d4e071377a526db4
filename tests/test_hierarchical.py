"""Hierarchical reduction on 4 real gloo ranks (and the same generator on the simulated world).

The reference is computed in-process from every rank's inputs: domain sums in rank
order, scaled by domains/world, then the compressor run on ``SimulatedWorld``. Inputs are
small integers, so every sum is exact in float32 and the results must be bit-identical:
the hierarchical result is exactly the global mean of what the compressor transmits.
The adaptive layer over these links (plans, re-plans, resume) is in
tests/test_hierarchical_adaptive.py; the helpers both use in tests/hierarchical_helpers.py.
"""

from __future__ import annotations

import eftopk  # noqa: F401  (registers test-eftopk and its ratio mapping)
import multiround  # noqa: F401  (registers test-multiround)
import pytest
import torch
from hierarchical_helpers import WORLD, _grad, _slots

from commpress.bandwidth.hierarchical import Place, hierarchical_reduction, hierarchy_scopes, shard_ranges, shard_slots
from commpress.bandwidth.hierarchy import Hierarchy
from commpress.bench.launch import run_local
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, ParamSlot, build

STEPS = 3
#: (index, [(name, shape)]) of the buckets every step reduces, in DDP's order
BUCKETS = [
    (0, [("fc2.weight", (3, 40)), ("fc2.bias", (3,))]),
    (1, [("fc1.weight", (40, 24)), ("fc1.bias", (40,)), ("embed", (5, 7))]),
    (2, [("single", (64,))]),
]
LAYOUTS = {
    "two-nodes": [[0, 1], [2, 3]],
    "unequal": [[0, 1, 2], [3]],
    "no-fast-links": [[0], [1], [2], [3]],
    "one-domain": [[0, 1, 2, 3]],
}
METHODS = [
    ("fp16", {}),
    ("topk", {"ratio": 0.3, "min_numel": 0}),
    ("terngrad", {}),
    ("powersgd", {"rank": 2, "min_compression_rate": 0.0}),
    ("acpsgd", {"rank": 2, "min_compression_rate": 0.0}),
    ("test-eftopk", {"ratio": 0.3}),
    ("test-multiround", {"jitter": 0.002}),
    ("none", {}),
]


def _hierarchical_runs(rank: int, world: int) -> dict:
    from commpress.comm.torch_backend import TorchBackend

    out = {}
    for layout, domains in LAYOUTS.items():
        plan = Hierarchy.of(domains)
        # enough cross rounds for every method below
        backend = TorchBackend(None, {"domain": 2, "cross": 3}, scopes=hierarchy_scopes(plan, world))
        place = Place.of(plan, rank)
        for method, params in METHODS:
            comp = build(method, params)
            results = []
            for step in range(STEPS):
                futures, buffers = [], []
                for index, spec in BUCKETS:
                    slots = _slots(spec)
                    buf = _grad(rank, step, index, sum(s.numel for s in slots))
                    buffers.append(buf)
                    futures.append(backend.run(hierarchical_reduction(Bucket(index, buf, slots), step, place, comp.reduce)))
                torch.futures.wait_all(futures)
                comp.end_step(True)
                results.append([b.clone() for b in buffers])
            out[layout, method] = results
    return out


def _reference(domains, method, params) -> list[list[torch.Tensor]]:
    world, d = WORLD, len(domains)
    shards = min(len(m) for m in domains) if d > 1 else len(domains[0])
    comps = {}
    results = []
    for step in range(STEPS):
        row = []
        for index, spec in BUCKETS:
            slots = _slots(spec)
            n = sum(s.numel for s in slots)
            grads = [_grad(r, step, index, n) for r in range(world)]
            out = torch.empty(n)
            for j, (a, b) in enumerate(shard_ranges(slots, n, shards)):
                sums = []
                for members in domains:
                    s = grads[members[0]][a:b].clone()
                    for r in members[1:]:
                        s += grads[r][a:b]
                    sums.append(s)
                if d == 1:
                    out[a:b] = sums[0].div_(world)
                    continue
                if a == b:
                    continue
                cross = comps.setdefault(j, [build(method, params) for _ in range(d)])
                buckets = [Bucket(index, s.mul_(d / world), shard_slots(slots, a, b)) for s in sums]
                SimulatedWorld(d).reduce(cross, buckets, step)
                out[a:b] = buckets[0].buffer
            row.append(out)
        for cross in comps.values():
            for c in cross:
                c.end_step(True)
        results.append(row)
    return results


@pytest.fixture(scope="module")
def hier():
    return run_local(_hierarchical_runs, WORLD)


def test_shard_ranges_cut_at_parameter_boundaries():
    slots = _slots([("w", (4, 5)), ("b", (4,)), ("v", (10, 3))])  # 20 + 4 + 30
    assert shard_ranges(slots, 54, 1) == [(0, 54)]
    assert shard_ranges(slots, 54, 2) == [(0, 24), (24, 54)]
    assert shard_ranges(slots, 54, 3) == [(0, 20), (20, 24), (24, 54)]  # 18 lies in w: its edge 20
    flat = _slots([("flat", (10,))])
    assert shard_ranges(flat, 10, 3) == [(0, 3), (3, 7), (7, 10)]  # 1-D: anywhere
    assert shard_ranges(_slots([("w", (2, 2))]), 4, 3) == [(0, 0), (0, 4), (4, 4)]
    assert shard_slots(slots, 20, 54) == (ParamSlot("b", torch.Size([4]), 0), ParamSlot("v", torch.Size([10, 3]), 4))
    assert shard_slots(flat, 3, 7) == (ParamSlot("flat", torch.Size([4]), 0),)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("method", "params"), METHODS)
def test_hierarchical_is_exactly_the_mean_of_what_the_compressor_sends(hier, layout, method, params):
    expected = _reference(LAYOUTS[layout], method, params)
    # The low-rank factors are not integers: a sum over more than two ranks depends on
    # gloo's order (ring) versus the reference's (rank order), a few float32 ulps that
    # orthonormalization can grow by ~100x; everything else is exact.
    exact = method not in ("powersgd", "acpsgd") or len(LAYOUTS[layout]) <= 2
    for rank in range(WORLD):
        got = hier[rank][layout, method]
        for step in range(STEPS):
            for g, e in zip(got[step], expected[step], strict=True):
                if exact:
                    assert torch.equal(g, e), (rank, step)
                else:
                    torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(a, b) for a, b in zip(got[-1], hier[0][layout, method][-1]))  # ranks agree


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("method", "params"), METHODS)
def test_hierarchical_runs_in_the_simulated_world(layout, method, params):
    """The same generator on the in-process backend: sums in rank order, so it equals the
    reference exactly for every method."""
    domains = LAYOUTS[layout]
    plan = Hierarchy.of(domains)
    world = SimulatedWorld(WORLD, hierarchy_scopes(plan, WORLD))
    comps = [build(method, params) for _ in range(WORLD)]
    places = [Place.of(plan, r) for r in range(WORLD)]
    expected = _reference(domains, method, params)
    for step in range(STEPS):
        for (index, spec), want in zip(BUCKETS, expected[step]):
            slots = _slots(spec)
            bufs = [_grad(r, step, index, sum(s.numel for s in slots)) for r in range(WORLD)]
            world.run(
                [hierarchical_reduction(Bucket(index, bufs[r], slots), step, places[r], comps[r].reduce) for r in range(WORLD)]
            )
            for r in range(WORLD):
                assert torch.equal(bufs[r], want), (layout, method, step, r)
        for c in comps:
            c.end_step(True)


@pytest.mark.multiproc
def test_uncompressed_hierarchical_is_the_global_mean(hier):
    for layout in LAYOUTS:
        for step in range(STEPS):
            for (index, spec), got in zip(BUCKETS, hier[0][layout, "none"][step]):
                n = sum(s.numel for s in _slots(spec))
                mean = torch.stack([_grad(r, step, index, n) for r in range(WORLD)]).mean(0)
                assert torch.equal(got, mean), layout  # integer inputs: no rounding at all
