"""The 1-bit compressor: error conservation, the exact decode, bytes, state, non-finite steps,
config errors (simulated world), and 2-rank gloo DDP training against the uncompressed run."""

from __future__ import annotations

import math

import pytest
import torch
from test_quant_ddp import _resume

from commpress import ConfigError
from commpress.bench.launch import run_local
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build

SIZES = (300, 41, 7, 1)
NAMES = ("w", "b", "c", "d")
ALL = {"min_numel": 0}  # every tensor signed, however small (min_numel has its own test)


def _grads(seed: int, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + i) for i, n in enumerate(sizes)]


def _bucket(grads, index: int = 0, names=NAMES, dtype=torch.float32) -> Bucket:
    return Bucket.from_tensors(index, [t.to(dtype) for t in grads], list(names)[: len(grads)])


def _step(sim: SimulatedWorld, comps, buckets, step: int = 0, commit: bool = True) -> list:
    finite = sim.reduce(comps, buckets, step)
    for c in comps:
        c.end_step(commit)
    return finite


def _residual(comp, names=NAMES) -> torch.Tensor:
    res = comp.state_dict()["residuals"]
    return torch.cat([res[n].reshape(-1) for n in names])


def _signed(acc: torch.Tensor) -> torch.Tensor:
    """scale * sign(acc) of one tensor, computed independently of the kernels (zero is +)."""
    scale = acc.double().abs().mean().float()
    return torch.where(acc < 0, -scale, scale)


def test_error_is_conserved():
    # one rank: decoded + new residual == grad + old residual, to the one float32 rounding of
    # the residual's subtraction
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("onebit", ALL))
    old = torch.zeros(sum(SIZES))
    for step in range(6):
        grad = torch.cat(_grads(step)) * (100.0 if step == 3 else 1.0)
        bucket = _bucket(_grads(step))
        bucket.buffer.copy_(grad)
        assert _step(sim, [comp], [bucket], step) == [True]
        new = _residual(comp)
        acc = grad + old
        assert ((bucket.buffer.double() + new.double() - acc.double()).abs() <= new.double().abs() * 2**-24).all()
        offset = 0
        for n in SIZES:  # what was sent is scale * sign(acc) per tensor
            assert torch.allclose(bucket.buffer[offset : offset + n], _signed(acc[offset : offset + n]), rtol=1e-6, atol=0)
            offset += n
        old = new
    assert old.abs().sum() > 0  # the residual is really carried


def test_the_average_is_the_mean_of_every_ranks_decode():
    world = 3
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build("onebit", ALL))
    residuals = [torch.zeros(sum(SIZES)) for _ in range(world)]
    for step in range(3):
        grads = [torch.cat(_grads(10 * step + r)) for r in range(world)]
        buckets = [_bucket(_grads(10 * step + r)) for r in range(world)]
        _step(sim, comps, buckets, step)
        accs = [g + e for g, e in zip(grads, residuals)]
        decoded = [torch.cat([_signed(a[o : o + n]) for o, n in zip((0, 300, 341, 348), SIZES)]) for a in accs]
        expected = (decoded[0] + decoded[1] + decoded[2]) / world  # in rank order, as the kernels add
        for b in buckets:
            assert torch.allclose(b.buffer, expected, rtol=1e-6, atol=1e-7)
            assert torch.equal(b.buffer, buckets[0].buffer)  # every rank holds the same average
        residuals = [_residual(c) for c in comps]
        for acc, dec, res in zip(accs, decoded, residuals):
            assert torch.allclose(dec + res, acc, rtol=1e-6, atol=1e-6)


def test_without_error_feedback_nothing_is_kept():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("onebit", {**ALL, "error_feedback": False}))
    for step in range(2):
        grads = [_grads(step + 7 * r) for r in range(2)]
        buckets = [_bucket(g) for g in grads]
        _step(sim, comps, buckets, step)
        fresh = [torch.cat([_signed(t) for t in g]) for g in grads]  # no residual is ever added
        assert torch.allclose(buckets[0].buffer, (fresh[0] + fresh[1]) / 2, rtol=1e-6, atol=1e-7)
    assert comps[0].state_dict() == {}


def test_small_tensors_travel_whole_and_are_averaged_exactly():
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("onebit", {"min_numel": 41}))
    grads = [_grads(r) for r in range(2)]
    buckets = [_bucket(g) for g in grads]
    _step(sim, comps, buckets)
    views = buckets[0].views()
    for i in (2, 3):  # 7 and 1 elements: exact averages
        assert torch.equal(views[i], (grads[0][i] + grads[1][i]) / 2)
    assert views[1].abs().unique().numel() <= 2  # 41 elements: signed, |s0 +- s1| / 2
    assert sorted(comps[0].state_dict()["residuals"]) == ["b", "w"]


def test_bytes_on_the_wire():
    comp = build("onebit", {"min_numel": 10})
    sizes = (300, 41, 9, 0, 8)
    bucket = _bucket([torch.randn(n) for n in sizes], names=[f"t{i}" for i in range(len(sizes))])
    # signed: ceil(n/8) + a float32 scale; under min_numel: 4 bytes an element
    expected = (math.ceil(300 / 8) + 4) + (math.ceil(41 / 8) + 4) + 4 * 9 + 4 * 8
    assert comp.transfers(bucket.slots)[0].nbytes == expected
    sim = SimulatedWorld(2)
    comps = [comp, build("onebit", {"min_numel": 10})]
    sim.reduce(comps, [bucket, _bucket([torch.randn(n) for n in sizes], names=[f"t{i}" for i in range(len(sizes))])])
    assert sim.backends[0].traffic.snapshot()["bytes_sent"] == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(dtype):
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("onebit", ALL))
    grads = [_grads(r) for r in range(2)]
    buckets = [_bucket(g, dtype=dtype) for g in grads]
    _step(sim, comps, buckets)
    decoded = [torch.cat([_signed(t.to(dtype).float()) for t in g]) for g in grads]
    assert buckets[0].buffer.dtype == dtype
    assert torch.equal(buckets[0].buffer, ((decoded[0] + decoded[1]) / 2).to(dtype))


def test_strided_buffer_gives_the_same_result():
    sim = SimulatedWorld(2)
    grads = [torch.cat(_grads(r)) for r in range(2)]
    dense = [_bucket(_grads(r)) for r in range(2)]
    wide = [torch.stack([g, torch.zeros_like(g)], 1) for g in grads]
    strided = [Bucket(0, w[:, 0], dense[0].slots) for w in wide]
    _step(sim, sim.compressors(lambda: build("onebit", ALL)), dense)
    _step(sim, sim.compressors(lambda: build("onebit", ALL)), strided)
    assert torch.equal(strided[0].buffer, dense[0].buffer) and not wide[0][:, 1].any()


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_step_is_non_finite_everywhere_and_keeps_the_old_state(bad):
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build("onebit", {"min_numel": 8}))
    _step(sim, comps, [_bucket(_grads(r)) for r in range(2)])
    before = [c.state_dict() for c in comps]
    grads = [_grads(5 + r) for r in range(2)]
    grads[1][0][17] = bad  # one element of one rank
    buckets = [_bucket(g) for g in grads]
    assert sim.reduce(comps, buckets, 1) == [False, False]
    for b in buckets:
        w = b.views()[0]
        assert not w.isfinite().any()  # the whole tensor, on every rank (GradScaler sees it)
        assert b.views()[1].isfinite().all()  # the others are averaged as usual
    for c, saved in zip(comps, before):
        c.end_step(True)  # even committed, such a step staged nothing
        assert all(torch.equal(saved["residuals"][k], v) for k, v in c.state_dict()["residuals"].items())


def test_state_dict_round_trip_and_exact_resume():
    world, steps, split = 2, 6, 3

    def run(comps, first, last):
        out = []
        for step in range(first, last):
            buckets = [_bucket(_grads(100 * step + r)) for r in range(world)]
            _step(sim, comps, buckets, step, commit=step != 4)  # one discarded step
            out.append(buckets[0].buffer)
        return out

    sim = SimulatedWorld(world)
    straight = run(sim.compressors(lambda: build("onebit", ALL)), 0, steps)
    comps = sim.compressors(lambda: build("onebit", ALL))
    run(comps, 0, split)
    saved = [c.state_dict() for c in comps]
    assert set(saved[0]["residuals"]) == set(NAMES)
    resumed = sim.compressors(lambda: build("onebit", ALL))
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
        assert all(torch.equal(s["residuals"][k], v) for k, v in c.state_dict()["residuals"].items())
    again = run(resumed, split, steps)
    assert all(torch.equal(a, b) for a, b in zip(straight[split:], again))
    with pytest.raises(ValueError, match=r"expects state with keys \[\]"):
        build("onebit", {"error_feedback": False}).load_state_dict(saved[0])
    with pytest.raises(ValueError, match=r"expects state with keys \['residuals'\]"):
        build("onebit").load_state_dict({})


def test_chunks_carry_a_scale_each_and_conserve_the_error():
    """chunk = 16: every 16 elements share a scale (the last run shorter); sent + residual
    is still the accumulated gradient, and the bytes are a scale and the signs per run."""
    sim = SimulatedWorld(1)
    (comp,) = sim.compressors(lambda: build("onebit", {**ALL, "chunk": 16}))
    grad = torch.cat(_grads(0))
    bucket = _bucket(_grads(0))
    _step(sim, [comp], [bucket])
    residual = _residual(comp)
    assert torch.allclose(bucket.buffer + residual, grad, rtol=1e-6, atol=1e-6)
    for at in range(0, 300, 16):  # the first tensor, 300 elements: 18 runs of 16 and one of 12
        run = grad[at : min(at + 16, 300)]
        assert torch.allclose(bucket.buffer[at : at + run.numel()], _signed(run), rtol=1e-6, atol=0)
    runs = [math.ceil(n / 16) for n in SIZES]
    assert comp.transfers(bucket.slots)[0].nbytes == sum(4 * r for r in runs) + sum(
        math.ceil(min(16, n - 16 * i) / 8) for n in SIZES for i in range(math.ceil(n / 16))
    )


def test_config_errors():
    for params, match in [
        ({"chunk": 12}, r"method 'onebit': chunk = 12 is not accepted; expected 0 \(one scale per tensor\) or a multiple of 8"),
        ({"min_numel": -1}, r"method 'onebit': min_numel = -1 is not accepted; expected an integer >= 0"),
        ({"error_feedback": "yes"}, r"error_feedback"),
        ({"ratio": 0.1}, r"ratio"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build("onebit", params)


# ---- 2-rank gloo DDP --------------------------------------------------------------------------

STEPS = 100


def _main(rank: int, world: int) -> dict:
    from commpress.workloads.train import train_ddp

    out = {name: train_ddp({"method": name}, steps=STEPS) for name in ("none", "onebit")}
    out["resume"] = _resume(rank, world, {"method": "onebit"}, steps=8, split=3)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_local(_main, 2)


@pytest.mark.multiproc
def test_ddp_trains_close_to_the_uncompressed_run(runs):
    # measured on this task (100 steps, lr 0.2): none 2.547, onebit 2.921 (+14.7%); one scale
    # for a whole 393K-element matrix is coarse, so the bound is wider than TernGrad's 5%
    ref, got = runs[0]["none"].eval_loss, runs[0]["onebit"].eval_loss
    assert abs(got - ref) / ref < 0.2, (got, ref)
    assert runs[0]["onebit"].eval_loss == runs[1]["onebit"].eval_loss  # ranks hold the same model
    assert runs[0]["onebit"].losses[-1] < 0.8 * runs[0]["onebit"].losses[0]  # it learns


@pytest.mark.multiproc
def test_ddp_bytes_and_exact_resume(runs):
    from commpress.compressors.topk import DEFAULT_MIN_NUMEL
    from commpress.workloads.charlm import CharTask

    sizes = [p.numel() for p in CharTask().model().parameters()]
    expected = sum(math.ceil(n / 8) + 4 if n >= DEFAULT_MIN_NUMEL else 4 * n for n in sizes)
    assert runs[0]["onebit"].bytes_per_step == expected
    for rank in range(2):
        straight, resumed = runs[rank]["resume"]
        assert torch.equal(straight, resumed)
