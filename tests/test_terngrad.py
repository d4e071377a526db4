"""TernGrad on the simulated world: unbiased, ternary, clipped, packed, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.compressors.wire.framing import frame, framed_nbytes, unframe


def _grads(seed: int = 0, sizes=(200, 37)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g) for n in sizes]
    out[0][:3] = torch.tensor([9.0, -7.0, 6.0])  # outliers, so that clipping at 2.5 sigma matters
    return out


def _buckets(per_rank: list[list[torch.Tensor]], index: int = 0, dtype=torch.float32) -> list[Bucket]:
    names = [f"t{i}" for i in range(len(per_rank[0]))]
    return [Bucket.from_tensors(index, [t.to(dtype) for t in ts], names) for ts in per_rank]


def _reduce(buckets: list[Bucket], step: int = 0, **params) -> SimulatedWorld:
    sim = SimulatedWorld(len(buckets))
    sim.reduce(sim.compressors(lambda: build("terngrad", params)), buckets, step=step)
    return sim


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.square().mean().sqrt()  # the standard deviation about zero


def _clipped(t: torch.Tensor, sigma: float = 2.5) -> torch.Tensor:
    bound = sigma * _rms(t)
    return t.clamp(-bound, bound)


def test_unbiased_mean_of_many_decodes_is_the_clipped_gradient():
    # Half the ranks hold g, half 2g; each rank quantizes against its own scale
    # S_r = max|clip(g_r)|. Each step's average is an average of `world` independent decodes
    # (ranks draw independent bits) whose expectation is (clip(g) + clip(2g)) / 2 = 1.5 clip(g).
    world, steps = 16, 64
    grads = _grads()
    doubled = [2 * g for g in grads]
    total = [torch.zeros_like(g) for g in grads]
    for step in range(steps):
        buckets = _buckets([grads if r % 2 == 0 else doubled for r in range(world)])
        _reduce(buckets, step=step)
        for acc, view in zip(total, buckets[0].views()):
            acc += view
    for acc, g in zip(total, grads):
        x1, x2 = _clipped(g), _clipped(2 * g)
        s1, s2 = x1.abs().max(), x2.abs().max()
        expected = (x1 + x2) / 2
        # One decode of x with scale S is S*sign(x) with probability |x|/S, else 0: mean x,
        # variance S|x| - x^2. The step average of world/2 decodes of x1 and world/2 of x2,
        # averaged over `steps` steps, has variance sum_r (S_r|x_r| - x_r^2) / world^2 / steps.
        # Allow 5 standard deviations per element (a false alarm has probability < 1e-6 per
        # element under the normal approximation, and the seeds are fixed), plus float32 rounding.
        var = (world / 2) * ((s1 * x1.abs() - x1 * x1) + (s2 * x2.abs() - x2 * x2)) / world**2 / steps
        sigma = var.clamp_min(0).sqrt()
        err = (acc / steps - expected).abs()
        assert (err <= 5 * sigma + 1e-5 * s2).all(), (err - 5 * sigma).max()
        # and it is a real test: without clipping the mean would be 1.5 g, far outside that band
        assert ((acc / steps - 1.5 * g).abs() > 5 * sigma + 1e-5 * s2).any()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 64, 101])
def test_outputs_are_ternary_for_every_length(n):
    # one rank: the decode is s * code, code in {-1, 0, 1}; lengths not divisible by 4
    # exercise the padding of the last packed byte
    g = torch.linspace(-1, 2, n) if n > 1 else torch.tensor([0.5])
    bucket = Bucket.from_tensors(0, [g.clone()], ["w"])
    sim = _reduce([bucket], step=3, clip_sigma=0.0)
    s = g.abs().max()
    out = bucket.buffer
    assert set(out.unique().tolist()) <= {-s.item(), 0.0, s.item()}
    nonzero = out != 0
    assert torch.equal(out[nonzero].sign(), g[nonzero].sign())  # signs survive packing
    assert out[g.abs() == s].abs().eq(s).all()  # probability |g|/s = 1: always kept
    assert sim.traffic[0].bytes_sent == math.ceil(n / 4) + 4


def test_each_rank_decodes_with_its_own_scale():
    # three ranks: g, 2g and zeros. Rank 1's scale is twice rank 0's, so world * average / s0
    # is c0 + 2 c1 (codes in {-1, 0, 1}): integers in [-3, 3], odd wherever rank 0 kept an
    # element. One scale shared by the ranks (their max, 2 s0) would make them all even.
    g = _grads()
    per_rank = [g, [2 * t for t in g], [torch.zeros_like(t) for t in g]]
    buckets = _buckets(per_rank)
    _reduce(buckets, step=1)
    for t, view in enumerate(buckets[0].views()):
        s0 = _clipped(g[t]).abs().max()
        units = view * 3 / s0
        assert (units - units.round()).abs().max() < 1e-5
        assert units.abs().max() <= 3 + 1e-5
        assert (units.round() % 2 == 1).any()
    for b in buckets[1:]:
        assert torch.equal(b.buffer, buckets[0].buffer)  # every rank decodes the same


def test_clipping_sets_the_scale():
    g = _grads()[0]
    for sigma, expected in [(0.0, g.abs().max()), (2.5, 2.5 * _rms(g)), (1.0, _rms(g))]:
        bucket = Bucket.from_tensors(0, [g.clone()], ["w"])
        _reduce([bucket], clip_sigma=sigma)
        assert abs(bucket.buffer.abs().max().item() - expected.item()) <= 1e-6 * expected.item()


def test_reproducible_and_independent_across_ranks_and_steps():
    grads = _grads()

    def once(step, seed=0):
        buckets = _buckets([grads] * 2)
        sim = SimulatedWorld(2)
        comps = sim.compressors(lambda: build("terngrad", {"seed": seed}))
        gens = [c.reduce(b, ctx) for c, b, ctx in zip(comps, buckets, _contexts(2, step))]
        return [next(gen).tensor.clone() for gen in gens]  # each rank's scales and packed codes

    a0, a1 = once(step=5)
    b0, b1 = once(step=5)
    c0, _ = once(step=6)
    d0, _ = once(step=5, seed=1)
    assert torch.equal(a0, b0) and torch.equal(a1, b1)  # same seed, rank, step: same bits
    assert not torch.equal(a0, a1)  # ranks draw independently
    assert not torch.equal(a0, c0)  # and steps
    assert not torch.equal(a0, d0)  # and the user's seed


def _contexts(world, step):
    from commpress.compressors import Context

    return [Context(rank=r, world_size=world, step=step) for r in range(world)]


def test_bytes_on_the_wire():
    sizes = (200, 37, 1, 6)
    buckets = _buckets([_grads(r, sizes) for r in range(2)])
    sim = _reduce(buckets)
    expected = sum(math.ceil(n / 4) for n in sizes) + 4 * len(sizes)  # codes + one fp32 scale per tensor
    for t in sim.traffic:
        assert t.bytes_sent == expected and t.collectives == 1


def test_all_zero_gradients():
    buckets = _buckets([[torch.zeros(10), torch.zeros(3)]] * 2)
    _reduce(buckets)
    assert torch.equal(buckets[0].buffer, torch.zeros(13))


def test_constant_and_offset_tensors_are_not_collapsed():
    # a constant tensor: rms = |c| < max|g| is false, no clipping; every element is kept
    # with probability 1, so the decode is exact
    buckets = _buckets([[torch.full((9,), -0.25)]] * 2)
    _reduce(buckets)
    assert torch.equal(buckets[0].buffer, torch.full((9,), -0.25))
    # a large common offset with small spread: the deviation about the mean (0.01) would
    # clip everything to 0.025; about zero, the scale stays near the values (~1)
    g = 1.0 + 0.01 * torch.randn(50, generator=torch.Generator().manual_seed(3))
    bucket = Bucket.from_tensors(0, [g.clone()], ["w"])
    _reduce([bucket])
    assert bucket.buffer.max() > 0.9


def test_empty_bucket_and_empty_tensor():
    sim = _reduce([Bucket(0, torch.zeros(0)) for _ in range(2)])
    assert sim.traffic[0].bytes_sent == 0 and sim.traffic[0].collectives == 0
    buckets = _buckets([[torch.ones(5), torch.zeros(0), torch.ones(2)]] * 2)
    sim = _reduce(buckets)
    assert torch.equal(buckets[0].buffer, torch.ones(7))
    assert sim.traffic[0].bytes_sent == 2 + 1 + 2 * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    grads = [g.to(dtype) for g in _grads()]
    buckets = _buckets([grads] * 2, dtype=dtype)
    _reduce(buckets, clip_sigma=0.0)
    assert buckets[0].buffer.dtype == dtype
    for view, g in zip(buckets[0].views(), grads):
        s = g.float().abs().max()
        units = view.float() * 2 / s
        # the decoded value is rounded once into the half dtype: 2^-8 relative for bf16
        assert (units - units.round()).abs().max() < 1e-2
        nonzero = view != 0
        assert torch.equal(view[nonzero].sign(), g[nonzero].sign())


def test_strided_buffer_gives_the_same_result():
    grads = _grads()
    dense = _buckets([grads] * 2)
    _reduce(dense, step=2)
    strided = []
    for b in _buckets([grads] * 2):
        big = torch.zeros(2 * b.buffer.numel())
        big[::2] = b.buffer
        strided.append(Bucket(0, big[::2], b.slots))
    _reduce(strided, step=2)
    assert not strided[0].buffer.is_contiguous()
    assert torch.equal(strided[0].buffer, dense[0].buffer)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_tensor_is_nan_on_every_rank(bad):
    # policy: a non-finite tensor on any rank poisons that tensor everywhere (so that
    # torch.amp's GradScaler skips the step on every rank); the other tensors are decoded
    per_rank = [_grads(seed=r) for r in range(2)]
    per_rank[1][0][5] = bad
    buckets = _buckets(per_rank)
    _reduce(buckets)
    for b in buckets:
        first, second = b.views()
        assert first.isnan().all()
        assert second.isfinite().all()


def test_config_errors():
    with pytest.raises(ConfigError, match=r"clip_sigma = -1.0 is not accepted; expected a number >= 0"):
        build("terngrad", {"clip_sigma": -1.0})
    with pytest.raises(ConfigError, match=r"clip_sigma = nan"):
        build("terngrad", {"clip_sigma": math.nan})
    with pytest.raises(ConfigError, match=r"seed = -1 is not accepted"):
        build("terngrad", {"seed": -1})
    with pytest.raises(ConfigError, match=r"unknown key 'ratio'"):
        build("terngrad", {"ratio": 0.1})
    with pytest.raises(TypeError, match="does not support gradient dtype int32"):
        _reduce([Bucket(0, torch.ones(4, dtype=torch.int32))])


def test_framing_round_trip():
    pieces = [torch.arange(5, dtype=torch.int32), torch.tensor([1.5, -2.0], dtype=torch.float16), torch.zeros(0)]
    layout = [(p.dtype, p.numel()) for p in pieces]
    frames = [frame([p * (r + 1) for p in pieces]) for r in range(3)]
    assert frames[0].dtype == torch.uint8 and frames[0].numel() == framed_nbytes(layout) == 24
    for j, rows in enumerate(unframe(frames, layout)):
        assert rows.shape == (3, pieces[j].numel()) and rows.dtype == pieces[j].dtype
        for r in range(3):
            assert torch.equal(rows[r], pieces[j] * (r + 1))
    with pytest.raises(ValueError, match="expected 24 uint8"):
        unframe([frames[0][:-1]], layout)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_same_bits_as_cpu():
    per_rank = [_grads(seed=r) for r in range(2)]
    cpu = _buckets(per_rank)
    gpu = [Bucket(b.index, b.buffer.cuda(), b.slots) for b in _buckets(per_rank)]
    _reduce(cpu, step=4)
    _reduce(gpu, step=4)
    assert torch.equal(gpu[0].buffer.cpu(), cpu[0].buffer)
