"""none / fp16 / bf16 on the simulated world: averages, identical ranks, bytes, dtypes."""

from __future__ import annotations

import pytest
import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build


def _buckets(world: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 4, 5)]
    return [
        Bucket.from_tensors(0, [torch.randn(s, generator=g).to(dtype) for s in shapes], ["w", "b", "c"]) for _ in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize(("method", "tol", "nbytes"), [("none", 1e-6, 4), ("fp16", 2e-3, 2), ("bf16", 2e-2, 2)])
def test_average_on_every_rank(world, method, tol, nbytes):
    buckets = _buckets(world)
    expected = torch.stack([b.buffer for b in buckets]).mean(0)
    sim = SimulatedWorld(world)
    sim.reduce(sim.compressors(lambda: build(method)), buckets)
    for b in buckets:
        assert torch.equal(b.buffer, buckets[0].buffer)  # every rank ends identical
    # fp16 keeps 11 significant bits (rel. error 2^-11 ~ 5e-4) on |values| < 4;
    # bf16 keeps 8 (2^-8 ~ 4e-3): the tolerances are a few units of that.
    torch.testing.assert_close(buckets[0].buffer, expected, atol=tol * 4, rtol=tol)
    n = buckets[0].buffer.numel()
    assert all(t.bytes_sent == n * nbytes and t.collectives == 1 for t in sim.traffic)


def test_none_divides_first_like_ddp():
    buckets = _buckets(3)
    expected = sum(b.buffer / 3 for b in buckets)
    sim = SimulatedWorld(3)
    sim.reduce(sim.compressors(lambda: build("none")), buckets)
    assert torch.equal(buckets[1].buffer, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method", ["none", "fp16", "bf16"])
def test_half_precision_and_float64_gradients(dtype, method):
    buckets = _buckets(2, dtype=dtype)
    expected = torch.stack([b.buffer.float() for b in buckets]).mean(0)
    sim = SimulatedWorld(2)
    sim.reduce(sim.compressors(lambda: build(method)), buckets)
    assert buckets[0].buffer.dtype == dtype
    torch.testing.assert_close(buckets[0].buffer.float(), expected, atol=0.05, rtol=0.02)


def test_unsupported_dtype_is_a_clear_error():
    bucket = Bucket(0, torch.arange(6, dtype=torch.int32))
    sim = SimulatedWorld(1)
    with pytest.raises(TypeError, match=r"does not support gradient dtype int32; accepted: float32, float16, bfloat16"):
        sim.reduce([build("fp16")], [bucket])


def test_empty_bucket_sends_nothing():
    sim = SimulatedWorld(2)
    buckets = [Bucket(0, torch.zeros(0)) for _ in range(2)]
    sim.reduce(sim.compressors(lambda: build("fp16")), buckets)
    assert sim.traffic[0].bytes_sent == 0


def test_bucket_views_and_layout():
    b = Bucket.from_tensors(7, [torch.ones(2, 3), torch.zeros(4)], ["a", "b"])
    assert b.index == 7 and b.layout == (("a", (2, 3)), ("b", (4,)))
    views = b.views()
    views[1].fill_(5)
    assert b.buffer[6:].eq(5).all() and views[0].shape == (2, 3)
    with pytest.raises(ValueError, match="1-D"):
        Bucket(0, torch.zeros(2, 2))


def test_stateless_compressor_refuses_foreign_state():
    c = build("none")
    assert c.state_dict() == {}
    with pytest.raises(ValueError, match="holds no state"):
        c.load_state_dict({"error": 1})
