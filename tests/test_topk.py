"""Top-k with error feedback on the simulated world: mass conservation, counts, bytes,
warm-up, small tensors sent whole, state, edge cases (DGC: tests/test_dgc.py; the values
sent as b-bit codes: tests/test_topk_values.py; shared helpers: tests/topk_helpers.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from topk_helpers import ALL, NAMES, SIZES, _bucket, _grads, _residual, _step, _straight_and_resumed

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Context, build
from commpress.compressors.topk import DEFAULT_MIN_NUMEL, topk_count


@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("selection", ["exact", "sampled"])
def test_mass_is_conserved_exactly(value_dtype, selection):
    # one rank: the decode is exactly what was sent, so sent + new residual must equal
    # grad + old residual bit for bit; a narrower wire dtype leaves its rounding error in
    # the residual (acc - round(acc) is exact in float32, Sterbenz), so it holds there too
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_dtype": value_dtype, "selection": selection}))
    old = torch.zeros(sum(SIZES))
    for step in range(6):
        grad = torch.cat(_grads(step)) * (100.0 if step == 3 else 1.0)
        bucket = _bucket(_grads(step))
        bucket.buffer.copy_(grad)
        _step(sim, [comp], [bucket], step=step)
        new = _residual(comp)
        assert torch.equal(bucket.buffer + new, grad + old)
        counts = [topk_count(0.05, n) for n in SIZES]
        assert int((bucket.buffer != 0).sum()) == sum(counts)
        old = new
    assert old.abs().sum() > 0  # the residual is really carried


def test_float16_wire_clamps_and_keeps_the_excess():
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.01, "value_dtype": "float16"}))
    grad = torch.zeros(100)
    grad[17] = 1e6  # beyond float16's range
    bucket = Bucket.from_tensors(0, [grad.clone()], ["w"])
    _step(sim, [comp], [bucket])
    assert bucket.buffer[17] == 65504 and bucket.buffer.isfinite().all()
    assert torch.equal(bucket.buffer + _residual(comp, ["w"]), grad)
    grad[3] = math.inf  # Inf is not clamped away: it must reach every rank
    bucket = Bucket.from_tensors(0, [grad.clone()], ["w"])
    _step(sim, [comp], [bucket], step=1)
    assert not bucket.buffer.isfinite().all()


def test_sends_the_largest_entries_of_each_tensor():
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1, "selection": "exact"}))
    grads = _grads(0)
    bucket = _bucket(grads)
    _step(sim, [comp], [bucket])
    for g, view in zip(grads, bucket.views()):
        k = topk_count(0.1, g.numel())
        top = g.abs().topk(k).indices
        expected = torch.zeros_like(g)
        expected[top] = g[top]
        assert torch.equal(view, expected)  # per tensor: even the 1-element tensor sends its entry


def test_average_over_ranks_of_what_each_sent():
    world = 3
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.02}))
    olds = [torch.zeros(sum(SIZES)) for _ in range(world)]
    for step in range(4):
        grads = [torch.cat(_grads(10 * step + r)) for r in range(world)]
        buckets = [_bucket(_grads(10 * step + r)) for r in range(world)]
        _step(sim, comps, buckets, step=step)
        news = [_residual(c) for c in comps]
        sent = [g + o - n for g, o, n in zip(grads, olds, news)]  # exact: entries are either sent or kept
        expected = sum(sent) / world
        for b in buckets:
            assert torch.equal(b.buffer, buckets[0].buffer)
        # float32 sums of up to 3 values in rank order, then / 3: a few ulps
        assert ((buckets[0].buffer - expected).abs() <= 1e-6 * expected.abs() + 1e-7).all()
        olds = news


@pytest.mark.parametrize(("value_dtype", "value_bytes"), [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_bytes_on_the_wire(value_dtype, value_bytes):
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.01, "value_dtype": value_dtype}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(2)])
    k = sum(topk_count(0.01, n) for n in SIZES)
    assert k == 3 + 1 + 1 + 1
    for t in sim.traffic:
        assert t.bytes_sent == k * (value_bytes + 4) and t.collectives == 1  # one gather, sizes known


def test_ratio_one_is_exact_averaging():
    # k = n for every tensor (the largest k a tensor allows): nothing is left behind
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 1.0}))
    buckets = [_bucket(_grads(r)) for r in range(2)]
    expected = (buckets[0].buffer + buckets[1].buffer) / 2
    _step(sim, comps, buckets)
    assert torch.equal(buckets[0].buffer, expected)
    assert _residual(comps[0]).abs().max() == 0


def test_warmup_schedule():
    comp = build("topk", {**ALL, "ratio": 0.01, "warmup_steps": 4, "warmup_ratio": 0.25})
    ratios = [comp.ratio_at(s) for s in range(6)]
    assert ratios[0] == 0.25 and ratios[4] == ratios[5] == 0.01
    # geometric: a constant factor (0.01 / 0.25) ** (1/4) per step, like DGC's stages
    for a, b in itertools.pairwise(ratios[:5]):
        assert b / a == pytest.approx((0.01 / 0.25) ** 0.25)
    sim = SimulatedWorld(1)
    _step(sim, [comp], [_bucket(_grads(0))], step=0)
    assert sim.traffic[0].bytes_sent == 8 * sum(topk_count(0.25, n) for n in SIZES)


def test_all_zero_gradients():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    buckets = [_bucket([torch.zeros(n) for n in SIZES]) for _ in range(2)]
    _step(sim, comps, buckets)
    assert torch.equal(buckets[0].buffer, torch.zeros(sum(SIZES)))
    assert torch.equal(_residual(comps[0]), torch.zeros(sum(SIZES)))


def test_empty_bucket_and_empty_tensor():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", ALL))
    _step(sim, comps, [Bucket(0, torch.zeros(0)) for _ in range(2)])
    assert sim.traffic[0].bytes_sent == 0 and sim.traffic[0].collectives == 0
    buckets = [_bucket([torch.ones(3), torch.zeros(0), torch.ones(1)], names=["x", "e", "y"]) for _ in range(2)]
    _step(sim, comps, buckets)
    assert torch.equal(buckets[0].buffer, torch.tensor([1.0, 0, 0, 1.0]))  # k = 1 of x, 1 of y
    assert sim.traffic[0].bytes_sent == 2 * 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    # the residual is float32; the decode is rounded once into the gradient's dtype
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    (ref,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    for step in range(3):
        grads = [g.to(dtype) for g in _grads(step)]
        half = _bucket(grads, dtype=dtype)
        full = _bucket([g.float() for g in grads])
        _step(sim, [comp], [half], step=step)
        _step(sim, [ref], [full], step=step)
        assert half.buffer.dtype == dtype
        assert torch.equal(half.buffer, full.buffer.to(dtype))
        assert torch.equal(_residual(comp), _residual(ref))


def test_strided_buffer_gives_the_same_result():
    sim = SimulatedWorld(1)
    (a,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    (b,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    for step in range(2):
        dense = _bucket(_grads(step))
        big = torch.zeros(2 * dense.buffer.numel())
        big[1::2] = dense.buffer
        strided = Bucket(0, big[1::2], dense.slots)
        _step(sim, [a], [dense], step=step)
        _step(sim, [b], [strided], step=step)
        assert not strided.buffer.is_contiguous()
        assert torch.equal(strided.buffer, dense.buffer)
        assert big[::2].eq(0).all()
    assert torch.equal(_residual(a), _residual(b))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_step_is_passed_through_and_keeps_residuals(bad):
    # policy: Inf/NaN on any rank makes every rank's decode non-finite (GradScaler then
    # skips the step everywhere) and no rank updates its residual from that step
    world = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(world)], step=0)
    before = [_residual(c) for c in comps]
    grads = [_grads(10 + r) for r in range(world)]
    grads[1][0][7] = bad
    buckets = [_bucket(g) for g in grads]
    _step(sim, comps, buckets, step=1)
    for b, c, old in zip(buckets, comps, before):
        assert not b.buffer.isfinite().all()
        assert torch.equal(_residual(c), old)
    # the next finite step carries on from the kept residuals
    buckets = [_bucket(_grads(20 + r)) for r in range(world)]
    _step(sim, comps, buckets, step=2)
    assert buckets[0].buffer.isfinite().all()
    for r, c in enumerate(comps):
        sent = torch.cat(_grads(20 + r)) + before[r] - _residual(c)
        assert int((sent != 0).sum()) == sum(topk_count(0.05, n) for n in SIZES)


def test_state_dict_resume_is_exact():
    fresh, straight, resumed = _straight_and_resumed({**ALL, "ratio": 0.05, "value_dtype": "float16"})
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"expects state with keys \['residuals'\]"):
        fresh.load_state_dict({"error": {}})


def test_residuals_follow_parameters_into_new_buckets():
    # DDP rebuilds its buckets after the first step: parameters move, their residuals too
    grads = _grads(0)
    ref = build("topk", {**ALL, "ratio": 0.05})
    moved = build("topk", {**ALL, "ratio": 0.05})
    sim = SimulatedWorld(1)
    _step(sim, [ref], [_bucket(grads)], step=0)
    _step(sim, [moved], [_bucket(grads)], step=0)  # one bucket holding w, b, c, d
    later = _grads(1)
    _step(sim, [ref], [_bucket(later)], step=1)
    # now bucket 0 holds d, c and bucket 1 holds b, w: new layouts, same parameters
    b0 = _bucket([later[3], later[2]], index=0, names=["d", "c"])
    b1 = _bucket([later[1], later[0]], index=1, names=["b", "w"])
    sim.reduce([moved], [b0], step=1)  # two buckets of one step, then the step ends
    sim.reduce([moved], [b1], step=1)
    moved.end_step(True)
    res_ref, res_moved = ref.state_dict()["residuals"], moved.state_dict()["residuals"]
    assert sorted(res_ref) == sorted(res_moved) == sorted(NAMES)
    for name in NAMES:
        assert torch.equal(res_ref[name], res_moved[name])


def test_flat_buckets_keep_separate_residuals():
    # buckets without parameter names are told apart by their index
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.1}))
    _step(sim, [comp], [Bucket(0, torch.arange(10.0))])
    _step(sim, [comp], [Bucket(1, -torch.arange(10.0))])
    res = comp.state_dict()["residuals"]
    assert torch.equal(res["flat0"], torch.arange(10.0).where(torch.arange(10) < 9, 0.0))
    assert torch.equal(res["flat1"], -res["flat0"])


def test_small_tensors_are_sent_whole_and_averaged_exactly():
    # default min_numel: "w" (5000 elements) is sparsified, "b" (30) and "c" (1023) are sent whole
    assert DEFAULT_MIN_NUMEL == 1024
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {"ratio": 0.01}))
    sizes, names = (5000, 30, 1023), ["w", "b", "c"]
    for step in range(3):
        grads = [_grads(10 * step + r, sizes) for r in range(2)]
        buckets = [_bucket(g, names=names) for g in grads]
        _step(sim, comps, buckets, step=step)
        w, b, c = buckets[0].views()
        assert torch.equal(b, (grads[0][1] + grads[1][1]) / 2) and torch.equal(c, (grads[0][2] + grads[1][2]) / 2)
        assert 0 < int((w != 0).sum()) <= 2 * topk_count(0.01, 5000)
    assert sorted(comps[0].state_dict()["residuals"]) == ["w"]  # nothing kept for what was sent whole
    k = topk_count(0.01, 5000)
    assert sim.traffic[0].bytes_sent == 3 * (8 * k + 4 * (30 + 1023)) and sim.traffic[0].collectives == 3


def test_a_bucket_of_small_tensors_only():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("topk", {"ratio": 0.01, "min_numel": 100}))
    grads = [_grads(r, (7, 40)) for r in range(2)]
    buckets = [_bucket(g, names=["a", "b"], dtype=torch.bfloat16) for g in grads]
    _step(sim, comps, buckets)
    expected = (torch.cat(grads[0]).to(torch.bfloat16).float() + torch.cat(grads[1]).to(torch.bfloat16).float()) / 2
    assert buckets[0].buffer.dtype == torch.bfloat16 and torch.equal(buckets[0].buffer, expected.to(torch.bfloat16))
    assert sim.traffic[0].bytes_sent == 4 * 47 and comps[0].state_dict() == {"residuals": {}}


def test_config_errors():
    for params, message in [
        ({"ratio": 0.0}, r"ratio = 0.0 is not accepted; expected a number in \(0, 1\]"),
        ({"ratio": 1.5}, r"ratio = 1.5 is not accepted"),
        ({"ratio": math.nan}, r"ratio = nan is not accepted"),
        ({"value_dtype": "int8"}, r"value_dtype = 'int8' is not accepted; expected one of 'float32', 'float16', 'bfloat16'"),
        ({"selection": "fast"}, r"selection = 'fast' is not accepted"),
        ({"warmup_steps": -1}, r"warmup_steps = -1 is not accepted; expected an integer >= 0"),
        ({"ratio": 0.1, "warmup_steps": 5, "warmup_ratio": 0.05}, r"warmup_ratio = 0.05 is not accepted.*\[ratio, 1\]"),
        ({"seed": 2**63}, r"seed = 9223372036854775808 is not accepted"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build("topk", params)
    with pytest.raises(TypeError, match="does not support gradient dtype float64"):
        sim = SimulatedWorld(1)
        _step(sim, [build("topk", ALL)], [Bucket(0, torch.ones(4, dtype=torch.float64))])


def test_context_step_drives_the_schedule_not_call_counts():
    comp = build("topk", {**ALL, "ratio": 0.01, "warmup_steps": 10})
    gen = comp.reduce(_bucket(_grads(0)), Context(rank=0, world_size=1, step=10))
    request = next(gen)
    assert request.nbytes == 8 * sum(topk_count(0.01, n) for n in SIZES)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_same_bits_as_cpu():
    sim = SimulatedWorld(2)
    cpu = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_dtype": "float16", "selection": "sampled"}))
    gpu = sim.compressors(lambda: build("topk", {**ALL, "ratio": 0.05, "value_dtype": "float16", "selection": "sampled"}))
    for step in range(3):
        a = [_bucket(_grads(10 * step + r)) for r in range(2)]
        b = [Bucket(x.index, x.buffer.cuda(), x.slots) for x in (_bucket(_grads(10 * step + r)) for r in range(2))]
        _step(sim, cpu, a, step=step)
        _step(sim, gpu, b, step=step)
        assert torch.equal(b[0].buffer.cpu(), a[0].buffer)
    assert torch.equal(_residual(gpu[1]).cpu(), _residual(cpu[1]))
