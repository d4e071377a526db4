"""The 1-bit sign kernels (numba) give the oracle's bits: codes, scales, acc, decode and residual,
on odd spans, several chunks, one and two threads, every dtype and the special values."""

import kernel_oracle
import pytest
import torch
from test_kernels_oracle import same_bits

import commpress.kernels as cc
from commpress.kernels._constants import STATS_LANES, STATS_ROWS

CHUNK = STATS_LANES * STATS_ROWS
# (offset, numel): gaps, odd lengths, an empty span, one of several chunks (several work items)
SPANS = [(0, 5), (7, 1), (8, 0), (8, 38), (50, 3 * CHUNK + 7), (50 + 3 * CHUNK + 7, 771)]
NUMEL = SPANS[-1][0] + SPANS[-1][1] + 11
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def buffer(seed: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 10.0, NUMEL)
    x[9], x[10] = 0.0, -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feedback", [False, True])
def test_pack_is_the_oracle(threads, dtype, feedback):
    x = buffer(1, dtype)
    error = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2)) if feedback else None
    accs = [torch.full((NUMEL,), 7.0) if feedback else None for _ in range(2)]
    ours, want = (ops.sign_pack_many(x, SPANS, error, acc) for ops, acc in zip((cc, kernel_oracle), accs))
    assert same_bits(ours, want)
    assert int(ours[0].sum()) > 0 and ours[0].numel() == sum(-(-n // 8) for _, n in SPANS)
    if feedback:
        assert same_bits(*accs) and accs[0][5:7].eq(7.0).all()  # written inside the spans only


def test_the_scale_is_the_mean_magnitude_and_zeros_count_as_plus():
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, -4.0, 3.0, 0.0, -0.5, 1.5])
    packed, scales = cc.sign_pack_many(x, [(0, 9), (2, 2), (0, 0)])
    assert packed.tolist() == [0b10010100, 0, 0b01]  # bit i of a byte: element i; -1, -4, -0.5 are minus
    assert scales.tolist() == [pytest.approx(12.0 / 9, rel=1e-7), 1.5, 0.0]
    assert scales.dtype == torch.float32


def test_non_finite_spans_have_non_finite_scales():
    x = torch.randn(40)
    x[3], x[17], x[30] = float("nan"), float("inf"), -float("inf")
    packed, scales = cc.sign_pack_many(x, [(0, 10), (10, 10), (20, 20), (0, 3)])
    assert scales[0].isnan() and scales[1] == float("inf") and scales[2] == float("inf") and scales[3].isfinite()
    assert ((packed[0] >> 3) & 1) == 0 and ((packed[5] >> 2) & 1) == 1  # NaN is +, -inf is minus (span 2, bit 10)
    out = torch.zeros(40)
    cc.sign_unpack_accumulate_many(packed.view(1, -1), scales.view(1, -1), [(0, 10), (10, 10), (20, 20), (0, 3)], out)
    assert out[3:10].isnan().all() and out[10:40].isinf().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_decode_and_residual_are_the_oracle(threads, dtype, world):
    payloads = [cc.sign_pack_many(buffer(r), SPANS) for r in range(world)]
    packed = torch.stack([p for p, _ in payloads])
    scales = torch.stack([s for _, s in payloads])
    scales[-1, 3] = 0.0  # a zero scale decodes to zeros
    for rank in range(world):
        outs = [buffer(9, dtype) for _ in range(2)]
        residuals = [buffer(rank) for _ in range(2)]
        cc.sign_unpack_accumulate_many(packed, scales, SPANS, outs[0], residuals[0], rank)
        kernel_oracle.sign_unpack_accumulate_many(packed, scales, SPANS, outs[1], residuals[1], rank)
        assert same_bits(*outs) and same_bits(*residuals)
        assert same_bits(outs[0][5:7], buffer(9, dtype)[5:7])  # outside the spans: untouched
    plain = [buffer(9, dtype) for _ in range(2)]
    for ops, out in zip((cc, kernel_oracle), plain):
        ops.sign_unpack_accumulate_many(packed, scales, SPANS, out)
    assert same_bits(*plain)


def test_decode_of_own_codes_plus_residual_is_acc():
    """acc = x + error; residual = acc - scale * sign(acc): adding the decoded value back gives
    acc to within one float32 rounding of the subtraction."""
    x, error, acc = buffer(4), buffer(5) * 0.1, torch.empty(NUMEL)
    packed, scales = cc.sign_pack_many(x, SPANS, error, acc)
    residual, decoded = acc.clone(), torch.zeros(NUMEL)
    cc.sign_unpack_accumulate_many(packed.view(1, -1), scales.view(1, -1), SPANS, decoded, residual, 0)
    for t, (o, n) in enumerate(SPANS):
        a, d, r = acc[o : o + n].double(), decoded[o : o + n].double(), residual[o : o + n].double()
        assert torch.equal(d.abs(), torch.full_like(d, float(scales[t])))
        assert torch.equal(d < 0, acc[o : o + n] < 0)
        assert ((r + d - a).abs() <= r.abs() * 2**-24).all()


def test_argument_errors():
    x = torch.randn(20)
    with pytest.raises(ValueError, match="error and acc come together"):
        cc.sign_pack_many(x, [(0, 20)], error=torch.zeros(20))
    with pytest.raises(TypeError, match=r"acc has dtype torch\.float16"):
        cc.sign_pack_many(x, [(0, 20)], torch.zeros(20), torch.zeros(20, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"span \(15, 6\) is not inside"):
        cc.sign_pack_many(x, [(15, 6)])
    packed, scales = cc.sign_pack_many(x, [(0, 20)])
    with pytest.raises(ValueError, match="packed has shape"):
        cc.sign_unpack_accumulate_many(packed.view(1, -1), scales.view(1, -1), [(0, 16)], x)
    with pytest.raises(ValueError, match="rank=1 is not one of the 1 ranks"):
        cc.sign_unpack_accumulate_many(packed.view(1, -1), scales.view(1, -1), [(0, 20)], x, torch.zeros(20), rank=1)
    with pytest.raises(ValueError, match="residual must be a contiguous buffer"):
        cc.sign_unpack_accumulate_many(packed.view(1, -1), scales.view(1, -1), [(0, 20)], x, torch.zeros(19))
