"""quant (b-bit stochastic quantization) on the simulated world: unbiased, exact where the
grid allows, error feedback conserved, bytes, non-finite steps, resume; and in 2-rank gloo DDP."""

from __future__ import annotations

import math

import pytest
import torch

from commpress import Config, ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Context, build
from commpress.compressors.quant import DEFAULT_BUCKET_SIZE
from commpress.compressors.wire.whole import DEFAULT_MIN_NUMEL

SIZES = (640, 192, 7)
NAMES = ("w", "v", "b")
ALL = {"min_numel": 0, "bucket_size": 64}  # every tensor quantized, several buckets per tensor


def _grads(seed: int, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + i) for i, n in enumerate(sizes)]


def _bucket(grads, index: int = 0, names=NAMES, dtype=torch.float32) -> Bucket:
    return Bucket.from_tensors(index, [t.to(dtype) for t in grads], list(names)[: len(grads)])


def _step(sim: SimulatedWorld, comps, buckets, step: int = 0) -> list:
    """One training step of one bucket per rank: reduce, then commit the staged state."""
    known = sim.reduce(comps, buckets, step)
    for c in comps:
        c.end_step(True)
    return known


def _residual(comp, names=NAMES) -> torch.Tensor:
    res = comp.state_dict()["residuals"]
    return torch.cat([res[n].reshape(-1) if n in res else torch.zeros(0) for n in names])


def _ranges(x: torch.Tensor, bucket_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: its bucket's min and scale (the quantizer's definition)."""
    lo = torch.stack([c.min() for c in x.split(bucket_size)]) + 0.0
    hi = torch.stack([c.max() for c in x.split(bucket_size)]) + 0.0
    counts = torch.tensor([c.numel() for c in x.split(bucket_size)])
    scale = (hi - lo) / (2**bits - 1)
    return lo.repeat_interleave(counts), scale.repeat_interleave(counts)


def test_defaults():
    c = build("quant")
    assert (c.bits, c.bucket_size, c.error_feedback, c.min_numel) == (8, 1024, False, 1024)
    assert DEFAULT_BUCKET_SIZE == 1024 and DEFAULT_MIN_NUMEL == 1024


@pytest.mark.parametrize("bits", [2, 8])
def test_unbiased_mean_of_many_decodes_is_the_average_gradient(bits):
    # Half the ranks hold g, half -0.5 g + 1; each rank quantizes against its own ranges.
    # One decode of x with scale s is lo + s*floor((x - lo)/s + u): mean x, variance
    # s^2 f (1 - f) <= s^2 / 4 (f the fractional part). The mean over `steps` steps of the
    # average of `world` independent decodes has variance sum_r s_r^2 f_r (1 - f_r) / world^2 / steps.
    world, steps, bucket_size = 8, 48, 64
    grads = _grads(0, SIZES[:2])
    other = [-0.5 * g + 1 for g in grads]
    per_rank = [grads if r % 2 == 0 else other for r in range(world)]
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("quant", {**ALL, "bits": bits}))
    total = torch.zeros(sum(SIZES[:2]))
    for step in range(steps):
        buckets = [_bucket(ts) for ts in per_rank]
        assert all(k is True for k in _step(sim, comps, buckets, step=step))
        total += buckets[0].buffer
    mean = total / steps
    var = torch.zeros_like(mean)
    nearest = torch.zeros_like(mean)  # what deterministic rounding to the nearest level would give
    for ts in per_rank:
        x = torch.cat(ts)
        lo, scale = torch.cat([torch.stack(_ranges(t, bucket_size, bits)) for t in ts], dim=1)
        f = ((x - lo) / scale).frac()
        var += scale**2 * f * (1 - f) / world**2 / steps
        nearest += (lo + ((x - lo) / scale).round() * scale) / world
    expected = sum(torch.cat(ts) for ts in per_rank) / world
    # 5 standard deviations per element (a false alarm has probability < 1e-6 per element
    # under the normal approximation, and the seeds are fixed), plus float32 rounding
    band = 5 * var.sqrt() + 1e-5 * expected.abs().max()
    err = (mean - expected).abs()
    assert (err <= band).all(), (err - band).max()
    # and it is a real test: rounding to the nearest level would be far outside that band
    assert ((nearest - expected).abs() > band).sum() > 0.1 * mean.numel()


def test_values_on_the_grid_and_constant_tensors_are_sent_exactly():
    # the codes of values that lie on the grid lo + j*scale are j (u < 1); a constant
    # tensor has scale 0 and decodes to its min
    grid = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, 0.0, 3.0, 1.0] * 4)  # 2 bits: levels 0..3, scale 1
    const = torch.full((40,), -0.3)
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", {"bits": 2, "bucket_size": 8, "min_numel": 0}))
    buckets = [_bucket([grid, const], names=["g", "c"]) for _ in range(2)]
    _step(sim, comps, buckets)
    assert torch.equal(buckets[0].buffer, torch.cat([grid, const]))


def test_codes_are_reproducible_and_independent_across_ranks_steps_and_seeds():
    def payload(rank: int, step: int, seed: int = 0) -> torch.Tensor:
        comp = build("quant", {**ALL, "bits": 2, "seed": seed})
        request = next(comp.reduce(_bucket(_grads(0)), Context(rank=rank, world_size=2, step=step)))
        return request.tensor

    base = payload(0, 0)
    assert torch.equal(base, payload(0, 0))
    for other in (payload(1, 0), payload(0, 1), payload(0, 0, seed=5)):
        assert not torch.equal(base, other)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bytes_on_the_wire(bits):
    # per quantized tensor ceil(n*b/8) codes + 8 bytes per bucket; the tensor of 7 elements
    # (under min_numel = 8) travels whole: 4 bytes an element
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", {"bits": bits, "bucket_size": 64, "min_numel": 8}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(2)])
    expected = sum(math.ceil(n * bits / 8) + 8 * math.ceil(n / 64) for n in SIZES[:2]) + 4 * 7
    for t in sim.traffic:
        assert t.bytes_sent == expected and t.collectives == 1
    assert sum(t.nbytes for t in comps[0].transfers(buckets_slots(), 4)) == expected


def buckets_slots():
    return _bucket(_grads(0)).slots


def test_small_tensors_are_sent_whole_and_averaged_exactly():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", {"bits": 4}))  # default min_numel 1024
    sizes, names = (2048, 30, 1023), ["w", "b", "c"]
    grads = [_grads(r, sizes) for r in range(2)]
    buckets = [_bucket(g, names=names) for g in grads]
    _step(sim, comps, buckets)
    w, b, c = buckets[0].views()
    assert torch.equal(b, (grads[0][1] + grads[1][1]) / 2) and torch.equal(c, (grads[0][2] + grads[1][2]) / 2)
    assert not torch.equal(w, (grads[0][0] + grads[1][0]) / 2)  # quantized
    assert sim.traffic[0].bytes_sent == 2048 // 2 + 8 * 2 + 4 * (30 + 1023)


@pytest.mark.parametrize("bits", [2, 8])
def test_error_feedback_conserves_what_is_not_sent(bits):
    # sent (each rank's own decode) + new residual == grad + old residual, up to the float32
    # rounding of one subtraction; the average is the mean of what the ranks sent
    world = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("quant", {**ALL, "bits": bits, "error_feedback": True}))
    olds = [torch.zeros(sum(SIZES)) for _ in range(world)]
    for step in range(5):
        grads = [torch.cat(_grads(10 * step + r)) * (50.0 if step == 3 else 1.0) for r in range(world)]
        buckets = [_bucket(_grads(10 * step + r)) for r in range(world)]
        for b, g in zip(buckets, grads):
            b.buffer.copy_(g)
        _step(sim, comps, buckets, step=step)
        news = [_residual(c) for c in comps]
        sent = [g + o - n for g, o, n in zip(grads, olds, news)]
        tol = 1e-6 * max(float((g + o).abs().max()) for g, o in zip(grads, olds))
        assert ((buckets[0].buffer - sum(sent) / world).abs() <= 2 * tol).all()
        # the residual is below one step of the rank's grid: what the rounding dropped
        for g, o, n in zip(grads, olds, news):
            acc = g + o
            _, scale = torch.cat([torch.stack(_ranges(t, 64, bits)) for t in acc.split(list(SIZES))], dim=1)
            assert (n.abs() <= scale * (1 + 1e-5) + tol).all()
        olds = news
    assert olds[0].abs().sum() > 0
    # with a single rank the decode is the own decode: sent + residual is the input
    sim1 = SimulatedWorld(1)
    (one,) = sim1.compressors(lambda: build("quant", {**ALL, "bits": bits, "error_feedback": True}))
    old = torch.zeros(sum(SIZES))
    for step in range(3):
        grad = torch.cat(_grads(step))
        b = _bucket(_grads(step))
        _step(sim1, [one], [b], step=step)
        new = _residual(one)
        assert ((b.buffer + new - (grad + old)).abs() <= 1e-6 * (grad + old).abs().max()).all()
        old = new


def test_error_feedback_off_keeps_no_state():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", ALL))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(2)])
    assert comps[0].state_dict() == {}
    with pytest.raises(ValueError, match=r"expects state with keys \[\]"):
        comps[0].load_state_dict({"residuals": {}})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_tensor_is_nan_on_every_rank_and_keeps_residuals(bad):
    world = 2
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("quant", {**ALL, "bits": 4, "error_feedback": True}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(world)], step=0)
    before = [_residual(c) for c in comps]
    grads = [_grads(10 + r) for r in range(world)]
    grads[1][0][100] = bad
    buckets = [_bucket(g) for g in grads]
    known = _step(sim, comps, buckets, step=1)
    assert known == [False, False]
    for b, c, old in zip(buckets, comps, before):
        w, v, small = b.views()
        assert w.isnan().all() and v.isfinite().all() and small.isfinite().all()
        assert torch.equal(_residual(c), old)


def test_state_dict_resume_is_exact_and_independent_of_the_bucket_layout():
    params = {**ALL, "bits": 2, "error_feedback": True}

    def run(steps, comp=None, split=False):
        sim = SimulatedWorld(1)
        comp = comp or build("quant", params)
        outs = []
        for step in steps:
            grads = _grads(step)
            if split:  # the same parameters in two buckets of another order
                buckets = [_bucket([grads[2], grads[1]], 0, ["b", "v"]), _bucket([grads[0]], 1, ["w"])]
                for bucket in buckets:
                    sim.reduce([comp], [bucket], step)
                comp.end_step(True)
                b, v = buckets[0].views()
                outs.append(torch.cat([buckets[1].buffer, v.reshape(-1), b.reshape(-1)]))
            else:
                bucket = _bucket(grads)
                _step(sim, [comp], [bucket], step=step)
                outs.append(bucket.buffer)
        return comp, outs

    _, straight = run(range(6))
    first, _ = run(range(3))
    fresh = build("quant", params)
    fresh.load_state_dict(first.state_dict())
    _, resumed = run(range(3, 6), fresh, split=True)
    for a, b in zip(straight[3:], resumed):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"expects state with keys \['residuals'\]"):
        fresh.load_state_dict({"error": {}})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", {**ALL, "bits": 8}))
    grads = [_grads(r) for r in range(2)]
    buckets = [_bucket(g, dtype=dtype) for g in grads]
    assert _step(sim, comps, buckets) == [True, True]
    expected = (torch.cat(grads[0]).to(dtype).float() + torch.cat(grads[1]).to(dtype).float()) / 2
    assert buckets[0].buffer.dtype == dtype
    # 8 bits over a range of about 8 standard deviations: a few hundredths at most
    assert (buckets[0].buffer.float() - expected).abs().max() < 0.1


def test_strided_buffer_gives_the_same_result():
    sim = SimulatedWorld(1)
    a, b = (build("quant", {**ALL, "bits": 4}) for _ in range(2))
    dense = _bucket(_grads(0))
    big = torch.zeros(2 * dense.buffer.numel())
    big[1::2] = dense.buffer
    strided = Bucket(0, big[1::2], dense.slots)
    _step(sim, [a], [dense])
    _step(sim, [b], [strided])
    assert not strided.buffer.is_contiguous() and torch.equal(strided.buffer, dense.buffer)
    assert big[::2].eq(0).all()


def test_empty_bucket_and_empty_tensor():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("quant", ALL))
    empty = [Bucket(0, torch.zeros(0)) for _ in range(2)]
    _step(sim, comps, empty)
    buckets = [Bucket.from_tensors(0, [torch.zeros(0), torch.ones(5)], ["e", "o"]) for _ in range(2)]
    _step(sim, comps, buckets)
    assert torch.equal(buckets[0].buffer, torch.ones(5))


def test_config_errors():
    for params, message in [
        ({"bits": 3}, r"method 'quant': bits = 3 is not accepted; expected one of 2, 4, 8"),
        ({"bits": 16}, r"bits = 16 is not accepted; expected one of 2, 4, 8"),
        ({"bucket_size": 12}, r"method 'quant': bucket_size = 12 is not accepted; expected a multiple of 8, >= 8"),
        ({"bucket_size": 0}, r"bucket_size = 0 is not accepted"),
        ({"error_feedback": "yes"}, r"error_feedback = 'yes' is not accepted; expected true or false"),
        ({"min_numel": -1}, r"min_numel = -1 is not accepted; expected an integer >= 0"),
        ({"seed": -1}, r"seed = -1 is not accepted; expected an integer in \[0, 2\*\*63\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build("quant", params)
        with pytest.raises(ConfigError, match=message):
            Config.load({"method": "quant", "params": params})
    with pytest.raises(TypeError, match="does not support gradient dtype float64"):
        _step(SimulatedWorld(1), [build("quant", ALL)], [Bucket(0, torch.ones(4, dtype=torch.float64))])


def test_a_ratio_sets_the_bits():
    c = build("quant", {"min_numel": 0})
    slots = _bucket(_grads(0, (4096, 2048))).slots
    assert c.params_for_ratio(0.01, slots) == {"bits": 2}  # nothing fits: the fewest bits
    assert c.params_for_ratio(0.07, slots) == {"bits": 2}  # 2/32 + 8/(4*1024) of float32's bytes
    assert c.params_for_ratio(0.13, slots) == {"bits": 4}
    assert c.params_for_ratio(0.26, slots) == {"bits": 8}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_same_bits_as_cpu():
    sim = SimulatedWorld(2)
    params = {**ALL, "bits": 4, "error_feedback": True}
    cpu = sim.compressors(lambda: build("quant", params))
    gpu = sim.compressors(lambda: build("quant", params))
    for step in range(3):
        a = [_bucket(_grads(10 * step + r)) for r in range(2)]
        b = [Bucket(x.index, x.buffer.cuda(), x.slots) for x in (_bucket(_grads(10 * step + r)) for r in range(2))]
        _step(sim, cpu, a, step=step)
        _step(sim, gpu, b, step=step)
        assert torch.equal(b[0].buffer.cpu(), a[0].buffer)
    assert torch.equal(_residual(gpu[1]).cpu(), _residual(cpu[1]))


# ---- 2-rank gloo DDP (commpress.hooks.register_ddp_hook through the demo's trainer)

DDP_STEPS = 60
DDP_CONFIGS = {
    "none": {"method": "none"},
    "quant": {"method": "quant"},
    "quant-2bit-ef": {"method": "quant", "params": {"bits": 2, "error_feedback": True}},
    "topk-2bit": {"method": "topk", "params": {"ratio": 0.05, "value_bits": 2}},
}


def _ddp_main(rank: int, world: int) -> dict:
    from commpress.workloads.train import train_ddp
    from tests.test_quant_ddp import _resume

    out = {name: train_ddp(cfg, steps=DDP_STEPS) for name, cfg in DDP_CONFIGS.items()}
    out["resume"] = _resume(rank, world, DDP_CONFIGS["quant-2bit-ef"], steps=6, split=3)
    return out


@pytest.fixture(scope="module")
def ddp_runs():
    from commpress.bench.launch import run_local

    return run_local(_ddp_main, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["quant", "quant-2bit-ef", "topk-2bit"])
def test_ddp_training_stays_close_to_the_uncompressed_reference(ddp_runs, name):
    ref = ddp_runs[0]["none"].eval_loss
    got = ddp_runs[0][name].eval_loss
    assert abs(got - ref) / ref < 0.03, (name, got, ref)  # measured within 1% at 60 steps
    assert ddp_runs[0][name].eval_loss == ddp_runs[1][name].eval_loss  # ranks hold the same model


@pytest.mark.multiproc
def test_ddp_bytes_per_step_match_the_formulas(ddp_runs):
    from commpress.workloads.charlm import CharTask

    sizes = [p.numel() for p in CharTask().model().parameters()]
    assert ddp_runs[0]["quant"].bytes_per_step == sum(
        n + 8 * math.ceil(n / 1024) if n >= DEFAULT_MIN_NUMEL else 4 * n for n in sizes
    )


@pytest.mark.multiproc
def test_ddp_resume_with_error_feedback_is_bit_exact(ddp_runs):
    for rank in range(2):
        straight, resumed = ddp_runs[rank]["resume"]
        assert torch.equal(straight, resumed)
