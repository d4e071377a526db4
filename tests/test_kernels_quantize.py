"""CPU kernels of commpress.kernels: b-bit bucketed quantization with stochastic rounding."""

import pytest
import torch

from commpress.kernels import dequantize, derive_seed, quantize_pack, uniform, unpack_accumulate, unpack_bits


def ref_quantize(x: torch.Tensor, bits: int, bucket: int, seed: int):
    """The definition, one bucket at a time in plain float32 torch ops."""
    levels = (1 << bits) - 1
    x = x.float()
    u = uniform(seed, x.numel())
    codes, mins, scales = [], [], []
    for start in range(0, x.numel(), bucket):
        xb, ub = x[start : start + bucket], u[start : start + bucket]
        lo, hi = xb.min() + 0.0, xb.max() + 0.0
        scale = (hi - lo) / levels
        if scale == 0:
            q = torch.zeros_like(xb)
        else:
            q = torch.floor((xb - lo.item()) / scale.item() + ub).clamp(0, levels).nan_to_num(0.0)
        codes.append(q.to(torch.uint8))
        mins.append(lo)
        scales.append(scale)
    return torch.cat(codes), torch.stack(mins), torch.stack(scales)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("bucket", [37, 512, 70000])
def test_codes_follow_the_definition(bits, bucket):
    n = 70000 + 13  # not a multiple of the bucket, spans several blocks
    gen = torch.Generator().manual_seed(bits * bucket)
    x = torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n)
    x[100:140] = 0.25  # a constant bucket (scale 0) when bucket == 37
    seed = derive_seed(bits, bucket)
    packed, mins, scales = quantize_pack(x, bits, bucket, seed)
    nb = -(-n // bucket)
    assert packed.shape == ((n * bits + 7) // 8,) and mins.shape == scales.shape == (nb,)
    codes, ref_mins, ref_scales = ref_quantize(x, bits, bucket, seed)
    assert torch.equal(mins, ref_mins) and torch.equal(scales, ref_scales)
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    decoded = dequantize(packed, mins, scales, bits, bucket, n)
    per_elem_scale = scales.repeat_interleave(bucket)[:n]
    # stochastic rounding moves each value by less than one step (plus float32 rounding slack)
    assert bool(((decoded - x).abs() <= per_elem_scale * (1 + 1e-5) + 1e-6).all())


def test_low_precision_inputs_and_nan_buckets():
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float16, torch.bfloat16):
        low = x.to(dtype)
        got = quantize_pack(low, 4, 64, 5)
        want = quantize_pack(low.float(), 4, 64, 5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    x[70] = float("nan")
    packed, mins, _ = quantize_pack(x, 8, 64, 5)
    codes = unpack_bits(packed, 8, 300)
    assert bool((codes[64:128] == 0).all()) and mins[1].isnan() and not mins[[0, 2, 3, 4]].isnan().any()


def test_quantization_is_unbiased():
    n, trials, bits, bucket = 256, 400, 2, 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    total = torch.zeros(n)
    for t in range(trials):
        p, lo, sc = quantize_pack(x, bits, bucket, derive_seed(1, t))
        total += dequantize(p, lo, sc, bits, bucket, n)
        scale = sc
    step = scale.repeat_interleave(bucket)
    # rounding error per element is within one step, variance <= step^2/4; 5 sigma of the mean
    assert bool(((total / trials - x).abs() < 5 * step / (2 * trials**0.5)).all())


def test_unpack_accumulate_sums_ranks_in_order():
    world, n, bits, bucket = 3, 1000, 4, 96
    gen = torch.Generator().manual_seed(5)
    payloads = [quantize_pack(torch.randn(n, generator=gen), bits, bucket, derive_seed(2, r)) for r in range(world)]
    packed, mins, scales = (torch.stack(parts) for parts in zip(*payloads))
    decoded = [dequantize(*p, bits, bucket, n) for p in payloads]
    for r in range(world):  # the decode itself: lo + q * scale, multiply then add
        q = unpack_bits(packed[r], bits, n).float()
        assert torch.equal(decoded[r], q * scales[r].repeat_interleave(bucket)[:n] + mins[r].repeat_interleave(bucket)[:n])
    total = decoded[0] + decoded[1] + decoded[2]
    out = torch.empty(n)
    assert unpack_accumulate(packed, mins, scales, bits, bucket, n, out) is out
    assert torch.equal(out, total / world)
    unpack_accumulate(packed, mins, scales, bits, bucket, n, out, average=False)
    assert torch.equal(out, total)
    half = torch.empty(n, dtype=torch.float16)
    assert torch.equal(unpack_accumulate(packed, mins, scales, bits, bucket, n, half), (total / world).half())


def test_quantize_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_pack(x, 3, 4, 0)
    with pytest.raises(ValueError, match="bucket_size=0"):
        quantize_pack(x, 2, 0, 0)
    with pytest.raises(TypeError, match="accepted dtypes"):
        quantize_pack(x.to(torch.int32), 2, 4, 0)
    p, lo, sc = quantize_pack(x, 2, 4, 0)
    with pytest.raises(ValueError, match="mins"):
        dequantize(p, lo[:2], sc, 2, 4, 10)
