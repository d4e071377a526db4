"""The batched TernGrad ops are the per-tensor ops applied span by span, bit for bit, on one and two threads."""

import pytest
import torch
from test_kernels_oracle import same_bits

import commpress.kernels as cc
from commpress.kernels.cpu._chunks import CHUNK

# (offset, numel): gaps between spans, odd lengths, a span of 0, one long span (several work items)
SPANS = [(0, 5), (7, 1), (8, 0), (8, 38), (50, 3 * CHUNK + 7), (50 + 3 * CHUNK + 7, 768)]
NUMEL = SPANS[-1][0] + SPANS[-1][1] + 11


def buffer(seed: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 3
    x[9], x[10] = float("nan"), -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_many_is_the_per_tensor_quantizer(threads, dtype):
    x = buffer(1, dtype)
    scales = torch.tensor([2.0, 0.0, 1.0, float("inf"), 5.0, float("nan")])  # 0, inf, NaN: zero codes
    bounds = torch.tensor([1.0, 1.0, float("inf"), 0.5, 0.0, 2.0])
    seeds = [11, 2**64 - 1, 3, 4, 5, 6]
    for b in (None, bounds):
        many = cc.ternary_quantize_pack_many(x, SPANS, scales, seeds, b)
        each = [
            cc.ternary_quantize_pack(x.narrow(0, o, n), scales[t], seeds[t], None if b is None else b[t])
            for t, (o, n) in enumerate(SPANS)
        ]
        assert torch.equal(many, torch.cat(each))
    assert int(many.sum()) > 0  # not all zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_many_is_the_per_tensor_decode(threads, dtype):
    world = 3
    payloads = [cc.ternary_quantize_pack_many(buffer(r), SPANS, torch.full((6,), 4.0), [r, 1, 2, 3, 4, 5]) for r in range(world)]
    packed = torch.stack(payloads)
    scales = torch.tensor([[4.0, 1.0, 2.0, 3.0, 4.0, 5.0], [4.0, 2.0, 0.0, -1.0, 1.5, 5.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = torch.full((NUMEL,), 7.0, dtype=dtype)
    expect = out.clone()
    assert cc.ternary_unpack_accumulate_many(packed, scales, SPANS, out) is out
    start = 0
    for t, (o, n) in enumerate(SPANS):
        m = (n + 3) // 4
        cc.ternary_unpack_accumulate(packed[:, start : start + m], scales[:, t].contiguous(), n, expect.narrow(0, o, n))
        start += m
    assert same_bits(out, expect)
    assert bool((out[-11:] == 7.0).all()) and out[5] == 7.0  # outside the spans: untouched


def test_many_argument_errors():
    x = torch.randn(100)
    with pytest.raises(ValueError, match=r"span \(90, 20\) is not inside the 100 elements"):
        cc.ternary_quantize_pack_many(x, [(90, 20)], torch.ones(1), [0])
    with pytest.raises(ValueError, match="seeds has 2 entries for 1 spans"):
        cc.ternary_quantize_pack_many(x, [(0, 10)], torch.ones(1), [0, 1])
    with pytest.raises(ValueError, match="scales has shape"):
        cc.ternary_quantize_pack_many(x, [(0, 10)], torch.ones(2), [0])
    with pytest.raises(ValueError, match=r"bounds must be numbers >= 0 \(inf: no clipping\), got \[-1.0\]"):
        cc.ternary_quantize_pack_many(x, [(0, 10)], torch.ones(1), [0], torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="packed has shape"):
        cc.ternary_unpack_accumulate_many(torch.zeros(2, 4, dtype=torch.uint8), torch.ones(2, 1), [(0, 10)], x)
    with pytest.raises(ValueError, match="flat contiguous"):
        cc.ternary_unpack_accumulate_many(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2, 1), [(0, 10)], x[::2])
