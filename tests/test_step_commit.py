"""Transactional steps: reductions stage state changes, ``end_step`` commits or drops them.

A step the optimizer skips (a non-finite gradient in one bucket) must leave every
bucket's state exactly as before, and training must then continue exactly like a run
that never saw that step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lowrank_helpers import NAMES, SHAPES, one_thread  # noqa: F401  (autouse: one thread for tiny LAPACK calls)

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, available, build

STATEFUL = [
    ("powersgd", {"rank": 2}),
    ("powersgd", {"rank": 2, "warm_start": False}),
    ("acpsgd", {"rank": 2}),
    ("acpsgd", {"rank": 2, "warm_start": False}),
    ("topk", {"ratio": 0.1, "value_dtype": "float16", "min_numel": 0}),  # small tensors: compress them all
]
# three buckets; the bad element goes into the middle one
GROUPS = [NAMES[:3], NAMES[3:7], NAMES[7:]]
WORLD = 3


def _grads(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{n: torch.randn(s, generator=g) for n, s in zip(NAMES, SHAPES)} for _ in range(WORLD)]


def _reduce(sim: SimulatedWorld, comps, per_rank: list[dict[str, torch.Tensor]], step: int) -> list[torch.Tensor]:
    """Reduce every bucket of one step (no end_step); returns rank 0's averaged buckets."""
    outs = []
    for index, names in enumerate(GROUPS):
        bs = [Bucket.from_tensors(index, [g[n] for n in names], names) for g in per_rank]
        sim.reduce(comps, bs, step)
        assert all(torch.equal(b.buffer.nan_to_num(7.0), bs[0].buffer.nan_to_num(7.0)) for b in bs)  # ranks agree
        outs.append(bs[0].buffer)
    return outs


def _flat(state: dict, prefix: str = "") -> dict[str, object]:
    """Every leaf of a state dict, by path."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a: dict, b: dict) -> bool:
    fa, fb = _flat(a), _flat(b)
    if fa.keys() != fb.keys():
        return False
    return all(torch.equal(x, fb[k]) if isinstance(x, torch.Tensor) else x == fb[k] for k, x in fa.items())


@pytest.mark.parametrize(("method", "params"), STATEFUL)
def test_state_dict_is_the_committed_state_until_end_step(method, params):
    sim = SimulatedWorld(WORLD)
    comps = sim.compressors(lambda: build(method, params))
    _reduce(sim, comps, _grads(0), 0)
    assert all(not part for c in comps for part in c.state_dict().values())  # nothing committed yet
    for c in comps:
        c.end_step(True)
    before = [copy.deepcopy(c.state_dict()) for c in comps]
    assert all(_flat(s) for s in before)
    _reduce(sim, comps, _grads(1), 1)
    assert all(_same(c.state_dict(), s) for c, s in zip(comps, before))  # staged, not applied
    for c in comps:
        c.end_step(True)
    assert not any(_same(c.state_dict(), s) for c, s in zip(comps, before))  # now applied


@pytest.mark.parametrize(("method", "params"), STATEFUL)
def test_discarded_step_leaves_no_trace(method, params):
    sim = SimulatedWorld(WORLD)
    comps, clean, committed = (sim.compressors(lambda: build(method, params)) for _ in range(3))
    bad_step = 2
    for step in range(6):
        per_rank = _grads(step)
        if step == bad_step:
            before = [copy.deepcopy(c.state_dict()) for c in comps]
            per_rank[1][GROUPS[1][1]].view(-1)[4] = float("nan")  # one element of the middle bucket
            for group, flip in ((comps, False), (committed, True)):
                outs = _reduce(sim, group, copy.deepcopy(per_rank), step)
                assert not torch.isfinite(outs[1]).all()  # every rank sees it: GradScaler skips the step
                assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[2]).all()
                for c in group:
                    c.end_step(flip)
            for c, saved in zip(comps, before):  # every bucket's state, bit for bit
                assert _same(c.state_dict(), saved)
            # the finite buckets did stage changes: committing them would have changed state
            assert not any(_same(c.state_dict(), saved) for c, saved in zip(committed, before))
            continue
        outs = _reduce(sim, comps, copy.deepcopy(per_rank), step)
        ref = _reduce(sim, clean, copy.deepcopy(per_rank), step)
        _reduce(sim, committed, per_rank, step)
        for group in (comps, clean, committed):
            for c in group:
                c.end_step(True)
        for a, b in zip(outs, ref):  # exactly the run that never saw the bad step
            assert torch.equal(a, b) and torch.isfinite(a).all()
    for c, r in zip(comps, clean):
        assert _same(c.state_dict(), r.state_dict())


@pytest.mark.parametrize("method", [m for m in available() if not m.startswith("test-")])
def test_every_compressor_has_end_step(method):
    comp = build(method)
    sim = SimulatedWorld(1)
    bucket = Bucket.from_tensors(0, [torch.ones(6, 5), torch.ones(3)], ["w", "b"])
    sim.reduce([comp], [bucket])
    comp.end_step(False)  # the only step so far dropped: nothing is kept
    assert all(not part for part in comp.state_dict().values())
    sim.reduce([comp], [bucket], 1)
    comp.end_step(True)
    comp.end_step(True)  # nothing staged: a no-op
    assert torch.isfinite(bucket.buffer).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_flag_sees_nan_and_both_infinities(dtype):
    from commpress.compressors import host

    x = torch.randn(1000).to(dtype)
    assert bool(host.finite(x, torch.empty(0, dtype=dtype)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[517] = bad
        assert not bool(host.finite(y)) and not bool(host.finite(x, y))
