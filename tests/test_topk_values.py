"""Top-k with ``value_bits``: the selected values sent as b-bit codes of each tensor's
selection (between its min and max) instead of floats. Mass conservation up to rounding, the
levels, unbiasedness, bytes, the non-finite policy, DGC, resume and config errors; the plain
Top-k tests are in tests/test_topk.py, the helpers both use in tests/topk_helpers.py."""

from __future__ import annotations

import math

import pytest
import torch
from topk_helpers import ALL, NAMES, SIZES, _bucket, _grads, _residual, _step, _straight_and_resumed

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import build
from commpress.compressors.topk import topk_count


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_values_conserve_mass(bits):
    # one rank: the decode is what was sent, so sent + new residual == grad + old residual,
    # up to the float32 rounding of (value - decoded) put back into the residual
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_bits": bits}))
    old = torch.zeros(sum(SIZES))
    for step in range(6):
        grad = torch.cat(_grads(step)) * (100.0 if step == 3 else 1.0)
        bucket = _bucket(_grads(step))
        bucket.buffer.copy_(grad)
        _step(sim, [comp], [bucket], step=step)
        new = _residual(comp)
        assert ((bucket.buffer + new - (grad + old)).abs() <= 1e-6 * (grad + old).abs().max()).all()
        assert int((bucket.buffer != 0).sum()) <= sum(topk_count(0.05, n) for n in SIZES)
        old = new
    assert old.abs().sum() > 0


@pytest.mark.parametrize("bits", [2, 8])
def test_quantized_values_in_a_bucket_of_whole_tensors_only(bits):
    # every tensor below min_numel goes whole: no values to quantize, the exact average
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {"ratio": 0.05, "value_bits": bits, "min_numel": 1000}))
    bs = [_bucket(_grads(seed)) for seed in (0, 1)]
    expected = (bs[0].buffer + bs[1].buffer) / 2
    _step(sim, comps, bs)
    for b in bs:
        torch.testing.assert_close(b.buffer, expected)


def test_quantized_values_are_b_bit_levels_of_each_tensors_selection():
    # per tensor the sent values take at most 2**bits distinct values between the
    # selection's min and max; the entries are the ones plain Top-k sends
    sim = SimulatedWorld(1)
    plain, coded = (build("topk", {**ALL, "ratio": 0.1, "selection": "exact", **p}) for p in ({}, {"value_bits": 2}))
    grads = _grads(0, (3000, 500))
    a, b = _bucket(grads, names=["w", "v"]), _bucket(grads, names=["w", "v"])
    _step(sim, [plain], [a])
    _step(sim, [coded], [b])
    for sent, values in zip(b.views(), a.views()):
        mask = values != 0
        assert torch.equal(sent != 0, mask) or bool((sent[mask] == 0).any())  # a code may decode to 0 only by chance
        levels = sent[mask].unique()
        assert len(levels) <= 4
        assert values[mask].min() - 1e-6 <= levels.min() and levels.max() <= values[mask].max() + 1e-6


def test_quantized_values_are_unbiased():
    # the mean over many steps of one rank's decoded values is the selected values
    grads = _grads(0, (2000,))
    total, steps = torch.zeros(2000), 200
    for step in range(steps):
        sim = SimulatedWorld(1)
        (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.02, "selection": "exact", "value_bits": 2}))
        b = _bucket(grads, names=["w"])
        _step(sim, [comp], [b], step=step)
        total += b.buffer
    top = grads[0].abs().topk(topk_count(0.02, 2000)).indices
    values = grads[0][top]
    scale = (values.max() - values.min()) / 3
    # one decode's variance is at most scale^2 / 4: 5 standard deviations of the mean
    assert ((total[top] / steps - values).abs() <= 5 * scale / 2 / math.sqrt(steps)).all()


def test_quantized_values_bytes_on_the_wire():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {"ratio": 0.01, "value_bits": 2, "min_numel": 100}))
    sizes, names = (5000, 300, 30), ["w", "v", "b"]
    _step(sim, comps, [_bucket(_grads(r, sizes), names=names) for r in range(2)])
    k = [topk_count(0.01, n) for n in sizes[:2]]
    assert k == [50, 3]
    expected = sum(4 * kt + math.ceil(kt * 2 / 8) + 8 for kt in k) + 4 * 30
    for t in sim.traffic:
        assert t.bytes_sent == expected and t.collectives == 1
    assert sum(t.nbytes for t in comps[0].transfers(_bucket(_grads(0, sizes), names=names).slots)) == expected


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_quantized_values_pass_non_finite_steps_through(bad):
    world = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_bits": 4}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(world)], step=0)
    before = [_residual(c) for c in comps]
    grads = [_grads(10 + r) for r in range(world)]
    grads[1][0][7] = bad
    buckets = [_bucket(g) for g in grads]
    assert sim.reduce(comps, buckets, 1) == [False, False]
    for c in comps:
        c.end_step(True)
    for b, c, old in zip(buckets, comps, before):
        assert b.views()[0].isnan().any()
        assert torch.equal(_residual(c), old)


def test_quantized_values_with_dgc_keep_the_error_in_the_velocity():
    # DGC sparsifies the velocity v = v + u; what the codes drop stays in v:
    # sent + new v == old v + new u (one rank, no masking: u is not cleared)
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_bits": 2, "dgc": True, "momentum": 0.9}))
    old_v = torch.zeros(sum(SIZES))
    for step in range(4):
        b = _bucket(_grads(step))
        _step(sim, [comp], [b], step=step)
        state = comp.state_dict()
        u = torch.cat([state["momentum"][n] for n in NAMES])
        v = torch.cat([state["velocity"][n] for n in NAMES])
        assert ((b.buffer + v - (old_v + u)).abs() <= 1e-5 * (old_v + u).abs().max()).all()
        old_v = v


def test_quantized_values_resume_exactly():
    _, straight, resumed = _straight_and_resumed({**ALL, "ratio": 0.05, "value_bits": 2})
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_value_bits_config_errors():
    for params, message in [
        ({"value_bits": 3}, r"method 'topk': value_bits = 3 is not accepted; expected one of 2, 4, 8"),
        ({"value_bits": 2, "value_dtype": "bfloat16"}, r"value_bits = 2 is not accepted with value_dtype = 'bfloat16'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build("topk", params)
