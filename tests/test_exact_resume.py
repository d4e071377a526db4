"""Exact resume and stable randomness: every random number a compressor draws is keyed by
(seed, parameter name, step, and rank where ranks must differ), never by a bucket's index
or layout, so a resumed run whose buckets are grouped differently (DDP's first step after a
resume uses its initial layout) continues bit for bit like the uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_oracle import mix64 as mix64_reference
from lowrank_helpers import NAMES, SHAPES, one_thread  # noqa: F401  (autouse: one thread for tiny LAPACK calls)

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Context, build
from commpress.compressors.lowrank_plan import LowRankPlan
from commpress.compressors.wire.seeding import mix64, shared_normal, stream_starts

WORLD = 3
# DDP's initial layout (one bucket, parameters in order) and its rebuilt one (three
# buckets, another grouping and order of the same named tensors)
INITIAL = [NAMES]
REBUILT = [NAMES[6:][::-1], NAMES[2:6], NAMES[:2][::-1]]
CASES = [
    ("powersgd", {"rank": 2, "warm_start": False}),
    ("powersgd", {"rank": 2}),
    ("acpsgd", {"rank": 2, "warm_start": False}),
    ("acpsgd", {"rank": 2}),
    ("topk", {"ratio": 0.1, "selection": "sampled", "min_numel": 0}),  # small tensors: compress them all
    ("terngrad", {}),
]


def _grads(step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + step)
    return [{n: torch.randn(s, generator=g) for n, s in zip(NAMES, SHAPES)} for _ in range(WORLD)]


def _step(sim: SimulatedWorld, comps, layout: list[list[str]], step: int) -> dict[str, torch.Tensor]:
    """One committed step over the buckets of ``layout``; rank 0's average of every parameter."""
    out = {}
    for index, names in enumerate(layout):
        bs = [Bucket.from_tensors(index, [g[n] for n in names], names) for g in _grads(step)]
        sim.reduce(comps, bs, step)
        out.update(zip(names, (v.clone() for v in bs[0].views())))
    for c in comps:
        c.end_step(True)
    return out


@pytest.mark.parametrize(("method", "params"), CASES)
def test_resume_with_another_bucket_layout_is_bit_identical(method, params):
    sim = SimulatedWorld(WORLD)
    straight = sim.compressors(lambda: build(method, params))
    first = sim.compressors(lambda: build(method, params))
    expected = [_step(sim, straight, INITIAL if step == 0 else REBUILT, step) for step in range(6)]
    for step in range(3):
        _step(sim, first, INITIAL if step == 0 else REBUILT, step)
    saved = [copy.deepcopy(c.state_dict()) for c in first]
    resumed = sim.compressors(lambda: build(method, params))
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
    for step in range(3, 6):  # a new process: the initial layout again, then the rebuilt one
        got = _step(sim, resumed, INITIAL if step == 3 else REBUILT, step)
        for name in NAMES:
            assert torch.equal(got[name], expected[step][name]), (step, name)
    for a, b in zip(resumed, straight):
        assert str(a.state_dict()) == str(b.state_dict())  # same names, counts, shapes
        for key, part in a.state_dict().items():
            for name, value in part.items():
                ref = b.state_dict()[key][name]
                assert torch.equal(value, ref) if isinstance(value, torch.Tensor) else value == ref


def _p_payload(comp, layout: list[list[str]], step: int, rank: int, world: int, grads) -> dict[str, torch.Tensor]:
    """ACP-SGD without warm start sends ``P = M Q`` from a fresh random Q every step: each
    matrix's block of the first payload, by name, for the buckets of ``layout``."""
    blocks = {}
    for index, names in enumerate(layout):
        bucket = Bucket.from_tensors(index, [grads[n] for n in names], names)
        plan = LowRankPlan.build(tuple(bucket.slots), comp.rank, comp.min_compression_rate)
        payload = next(comp.reduce(bucket, Context(rank=rank, world_size=world, step=step))).tensor
        for f in plan.factors:
            blocks[f.slot.name] = payload[f.p_offset : f.p_offset + f.n * f.rank].clone()
    return blocks


def test_random_factors_are_shared_by_ranks_and_keyed_by_name_and_step():
    grads = _grads(0)[0]  # the same gradients on every rank: P differs only if Q does
    comp = lambda: build("acpsgd", {"rank": 2, "warm_start": False, "error_feedback": False})  # noqa: E731
    a = _p_payload(comp(), INITIAL, step=4, rank=0, world=2, grads=grads)
    b = _p_payload(comp(), INITIAL, step=4, rank=1, world=2, grads=grads)  # another rank, no communication
    c = _p_payload(comp(), REBUILT, step=4, rank=0, world=2, grads=grads)  # another bucket layout
    d = _p_payload(comp(), INITIAL, step=5, rank=0, world=2, grads=grads)  # the next step
    e = _p_payload(build("acpsgd", {"rank": 2, "warm_start": False, "seed": 1}), INITIAL, 4, 0, 2, grads)
    assert a.keys() == b.keys() == c.keys() and len(a) >= 4
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name])
        assert not torch.equal(a[name], d[name]) and not torch.equal(a[name], e[name])
    same_shape = [n for n, s in zip(NAMES, SHAPES) if s == (12, 10)]
    assert not torch.equal(a[same_shape[0]], a[same_shape[1]])  # parameters draw their own numbers


def test_shared_normal_is_splitmix64_and_standard_normal():
    words = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    signed = torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64)
    assert [v & (2**64 - 1) for v in mix64(signed).tolist()] == [mix64_reference(w) for w in words]
    starts = stream_starts(0, [("a", 40_000), ("b", 20_000)], torch.device("cpu"))
    x = shared_normal(starts, draw=3)
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    # 60 000 draws: the mean within 5 standard errors of 0, the variance within 5% of 1
    assert abs(x.mean().item()) < 5 / 60_000**0.5 and abs(x.var().item() - 1) < 0.05
    assert torch.equal(x, shared_normal(starts, draw=3)) and not torch.equal(x, shared_normal(starts, draw=4))
    alone = shared_normal(stream_starts(0, [("b", 20_000)], torch.device("cpu")), draw=3)
    assert torch.equal(x[40_000:], alone)  # a name's numbers do not depend on its neighbours
