"""Properties both low-rank compressors share, on the simulated world with many ranks:
error conservation, identical ranks, bad input, half precision, the non-finite policy,
checkpoints and state that follows its parameters when buckets change."""

from __future__ import annotations

import copy

import pytest
import torch
from lowrank_helpers import (
    NAMES,
    buckets,
    error_of,
    grads,
    one_thread,  # noqa: F401  (autouse: one thread for tiny LAPACK calls)
    reduce_step,
    run,
)

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.config import Config

METHODS = ["powersgd", "acpsgd"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "params", [{"rank": 1}, {"rank": 3}, {"rank": 2, "warm_start": False}, {"rank": 2, "min_compression_rate": 0.5}]
)
def test_error_conservation_and_identical_ranks(method, params):
    world = 5
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, params))
    for step in range(5):
        bs = buckets(grads(world, seed=10 + step))
        old = [error_of(c, b) for c, b in zip(comps, bs)]
        target = torch.stack([b.buffer + e for b, e in zip(bs, old)]).mean(0)
        reduce_step(sim, comps, bs, step)
        for b in bs:
            assert torch.equal(b.buffer, bs[0].buffer)  # every rank ends identical
        new = torch.stack([error_of(c, b) for c, b in zip(comps, bs)]).mean(0)
        # result + mean(new error) == mean(grad + old error): one float32 rounding of
        # values of size ~1-10 per term, so 1e-5 absolute is several ulps of slack
        torch.testing.assert_close(bs[0].buffer + new, target, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_without_error_feedback_no_error_is_kept(method):
    comps, bs, _ = run(method, {"rank": 2, "error_feedback": False}, world=3, steps=3)
    state = comps[0].state_dict()
    assert state["error"] == {} and state["q" if method == "powersgd" else "p"]  # factors are kept
    assert all(torch.equal(b.buffer, bs[0].buffer) for b in bs) and torch.isfinite(bs[0].buffer).all()


@pytest.mark.parametrize("method", METHODS)
def test_bad_parameters_are_config_errors(method):
    with pytest.raises(ConfigError, match=rf"method '{method}': rank = 0 is not accepted; expected an integer >= 1"):
        build(method, {"rank": 0})
    with pytest.raises(ConfigError, match=r"min_compression_rate = -1.0 is not accepted"):
        build(method, {"min_compression_rate": -1})
    with pytest.raises(ConfigError, match=r"rank = 2.5 is not accepted; expected an integer"):
        Config.load({"method": method, "params": {"rank": 2.5}})
    with pytest.raises(ConfigError, match=r"unknown key 'start_iter'"):  # it is the top-level key
        Config.load({"method": method, "params": {"start_iter": 3}})
    assert Config.load({"method": method, "start_iter": 3, "params": {"rank": 2}}).start_iter == 3


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_compute_in_fp32(method, dtype):
    world = 3
    half = grads(world, seed=3, dtype=dtype)
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, {"rank": 2}))
    ref_comps = sim.compressors(lambda: build(method, {"rank": 2}))
    for step in range(3):
        hb = buckets(grads(world, seed=20 + step, dtype=dtype))
        fb = [Bucket(b.index, b.buffer.float(), b.slots) for b in hb]  # the same values in fp32
        reduce_step(sim, comps, hb, step)
        reduce_step(sim, ref_comps, fb, step)
        assert hb[0].buffer.dtype == dtype and all(torch.equal(b.buffer, hb[0].buffer) for b in hb)
        # the fp32 computation rounded once to the half dtype: within one ulp (2^-10 / 2^-7 relative)
        ulp = 2**-10 if dtype == torch.float16 else 2**-7
        torch.testing.assert_close(hb[0].buffer.float(), fb[0].buffer.to(dtype).float(), atol=ulp * 8, rtol=ulp)
    assert half[0][0].dtype == dtype


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", [0, 1])  # inf in a compressed matrix / nan in a 1-D tensor
def test_non_finite_step_is_dropped_and_training_recovers(method, where):
    world, bad_step = 3, 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, {"rank": 2}))
    clean = sim.compressors(lambda: build(method, {"rank": 2}))  # never sees the bad step
    for step in range(5):
        gs = grads(world, seed=30 + step)
        if step == bad_step:
            gs[1][where].view(-1)[3] = float("inf") if where == 0 else float("nan")
            before = [c.state_dict() for c in comps]
            bs = buckets(gs)
            # committed even so (a caller without GradScaler): the bucket staged nothing
            reduce_step(sim, comps, bs, step, commit=True)
            for b in bs:  # every rank sees a non-finite gradient: GradScaler skips the step
                assert not torch.isfinite(b.buffer).all()
            for c, saved in zip(comps, before):  # error, factors and step counts are untouched
                assert_same_state(c.state_dict(), saved)
            continue
        bs, ref = buckets(gs), buckets(copy.deepcopy(gs))
        reduce_step(sim, comps, bs, step)
        reduce_step(sim, clean, ref, step)
        for b, r in zip(bs, ref):  # the next finite steps are exactly those of a run without it
            assert torch.equal(b.buffer, r.buffer) and torch.isfinite(b.buffer).all()


@pytest.mark.parametrize("method", METHODS)
def test_state_dict_resume_is_bit_identical(method):
    world = 3
    sim = SimulatedWorld(world)
    straight = sim.compressors(lambda: build(method, {"rank": 2}))
    first = sim.compressors(lambda: build(method, {"rank": 2}))
    outs = {}
    for step in range(3):
        reduce_step(sim, straight, buckets(grads(world, step)), step)
        reduce_step(sim, first, buckets(grads(world, step)), step)
    saved = [copy.deepcopy(c.state_dict()) for c in first]
    resumed = sim.compressors(lambda: build(method, {"rank": 2}))
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
    for step in range(3, 6):
        for key, comps in (("straight", straight), ("resumed", resumed)):
            bs = buckets(grads(world, step))
            reduce_step(sim, comps, bs, step)
            outs[key] = bs[0].buffer
        assert torch.equal(outs["straight"], outs["resumed"])
    with pytest.raises(ValueError, match=r"exactly the keys \['error', 'p', 'q'\], got \['error'\]"):
        resumed[0].load_state_dict({"error": 1})


@pytest.mark.parametrize("method", METHODS)
def test_state_follows_parameters_when_buckets_are_rebuilt(method):
    """DDP's first step uses one layout, later steps another: each parameter's error (and
    warm start) is found by name in its new bucket, so error conservation holds across the
    rebuild."""
    world = 3
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, {"rank": 2}))
    gs = grads(world, 40)
    first = buckets(gs)
    reduce_step(sim, comps, first, 0)
    old = {name: [] for name in NAMES}
    for c, b in zip(comps, first):
        err = error_of(c, b)
        for s in b.slots:
            old[s.name].append(err[s.offset : s.offset + s.numel])
    # rebuild: two buckets in reverse order, bucket 0 now holds other parameters
    split = [NAMES[:4][::-1], NAMES[4:][::-1]]
    gs2 = grads(world, 41)
    by_name = [dict(zip(NAMES, g)) for g in gs2]
    for index, names in enumerate(split[::-1]):
        bs = [Bucket.from_tensors(index, [g[n] for n in names], names) for g in by_name]
        target = torch.stack([b.buffer + torch.cat([old[n][r] for n in names]) for r, b in enumerate(bs)]).mean(0)
        sim.reduce(comps, bs, 1)
        for c in comps:
            c.end_step(True)
        new = torch.stack([error_of(c, b) for c, b in zip(comps, bs)]).mean(0)
        torch.testing.assert_close(bs[0].buffer + new, target, atol=1e-5, rtol=1e-5)
        assert all(torch.equal(b.buffer, bs[0].buffer) for b in bs)


def assert_same_state(now: dict, saved: dict) -> None:
    """Bit-identical low-rank state: the same names and tensors."""
    assert now.keys() == saved.keys()
    for kind in ("error", "q", "p"):
        assert now[kind].keys() == saved[kind].keys()
        for name, t in saved[kind].items():
            assert torch.equal(now[kind][name], t), (kind, name)


@pytest.mark.parametrize("method", METHODS)
def test_error_is_double_buffered(method):
    """M = grad + error is written into the buffer the committed error does not use: after
    the first step a bucket's steps alternate between two buffers, with no new ones."""
    comps, _, sim = run(method, {"rank": 2}, world=2, steps=2)
    seen = []
    for step in range(2, 7):
        reduce_step(sim, comps, buckets(grads(2, step)), step, commit=step != 4)  # one step dropped
        seen += comps[0]._layouts[0].buffers
    assert len({id(b) for b in seen}) == 2
