"""CPU kernels of commpress.kernels: TernGrad quantization, top-k selection, error feedback."""

import pytest
import torch

from commpress.kernels import (
    add_error,
    derive_seed,
    scatter_add_decode,
    ternary_quantize_pack,
    ternary_unpack_accumulate,
    topk_select,
    uniform,
    unpack_bits,
    update_error,
)
from commpress.kernels.cpu._chunks import CHUNK


def ref_ternary_codes(x: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    """The definition, unchunked in plain torch ops: keep when u < |x| / scale, code 1 or 2 by sign."""
    u = uniform(seed, x.numel())
    keep = u < x.float().abs() / scale  # division by a Python float is IEEE division in torch
    return torch.where(keep, torch.where(torch.signbit(x), 2, 1), 0).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ternary_codes_follow_the_definition(dtype):
    n = CHUNK + 1003  # two blocks, length not divisible by 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[5] = 0.0
    x[6] = -0.0
    scale = x.float().abs().max()
    seed = derive_seed(3, 0, 1)
    packed = ternary_quantize_pack(x, scale, seed)
    assert packed.shape == ((n + 3) // 4,) and packed.dtype == torch.uint8
    codes = unpack_bits(packed, 2, n)
    assert torch.equal(codes, ref_ternary_codes(x, scale.item(), seed))
    assert codes[5] == 0 and codes[6] == 0
    assert int(codes.max()) <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ternary_bound_clamps_before_quantizing(dtype):
    n = CHUNK + 1003
    x = (3 * torch.randn(n, generator=torch.Generator().manual_seed(12))).to(dtype)
    x[7] = float("nan")
    scale = x.float().nan_to_num(0.0).abs().max() * 0.8
    bound = torch.tensor(0.7)
    seed = derive_seed(4, 2)
    packed = ternary_quantize_pack(x, scale, seed, bound)
    clamped = x.float().clamp(-0.7, 0.7)  # in float32: the bound is not rounded to x's dtype
    assert torch.equal(unpack_bits(packed, 2, n), ref_ternary_codes(clamped, scale.item(), seed))
    assert torch.equal(packed, ternary_quantize_pack(clamped, scale, seed))
    assert not torch.equal(packed, ternary_quantize_pack(x, scale, seed))  # the bound changed the draws' outcome
    assert torch.equal(ternary_quantize_pack(x, scale, seed, torch.tensor(float("inf"))), ternary_quantize_pack(x, scale, seed))


def test_ternary_special_scales_and_nan():
    x = torch.tensor([1.0, -2.0, float("nan"), 0.5])
    assert ternary_quantize_pack(x, torch.tensor(0.0), 1).tolist() == [0]
    codes = unpack_bits(ternary_quantize_pack(x, torch.tensor(2.0), 1), 2, 4)
    assert codes[1] == 2 and codes[2] == 0  # |x| == scale is always kept; NaN never


def test_ternary_is_unbiased():
    n, trials = 512, 400
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    scale = x.abs().max()
    total = torch.zeros(n)
    out = torch.empty(n)
    for t in range(trials):
        ternary_unpack_accumulate(ternary_quantize_pack(x, scale, derive_seed(9, t))[None], scale[None], n, out)
        total += out
    mean = total / trials
    # per element Var = scale*|x| - x^2 <= scale^2/4, so std of the mean <= scale/(2*sqrt(trials)); 5 sigma
    assert (mean - x).abs().max() < 5 * scale / (2 * trials**0.5)


def test_ternary_accumulate_sums_ranks_in_order():
    world, n = 3, 1001
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, generator=gen) for _ in range(world)]
    scales = torch.stack([x.abs().max() for x in xs])
    packed = torch.stack([ternary_quantize_pack(x, s, derive_seed(5, r)) for r, (x, s) in enumerate(zip(xs, scales))])
    expect = torch.zeros(n)
    for r in range(world):
        codes = unpack_bits(packed[r], 2, n)
        value = torch.where(codes == 1, scales[r], torch.where(codes == 2, -scales[r], 0.0))
        expect = value if r == 0 else expect + value
    expect = expect / world
    out = torch.empty(n)
    assert ternary_unpack_accumulate(packed, scales, n, out) is out
    assert torch.equal(out, expect)
    for dtype in (torch.float16, torch.bfloat16):
        low = torch.empty(n, dtype=dtype)
        ternary_unpack_accumulate(packed, scales, n, low)
        assert torch.equal(low, expect.to(dtype))


def test_ternary_errors():
    x = torch.randn(8)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ternary_quantize_pack(x.double(), torch.tensor(1.0), 0)
    with pytest.raises(TypeError, match="scale"):
        ternary_quantize_pack(x, torch.tensor(1.0, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="one device"):
        ternary_quantize_pack(x, torch.tensor(1.0, device="meta"), 0)
    with pytest.raises(ValueError, match="packed"):
        ternary_unpack_accumulate(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2), 8, torch.empty(8))


@pytest.mark.parametrize("exact", [False, True])
def test_topk_selects_the_k_largest_and_zeroes_them(exact):
    gen = torch.Generator().manual_seed(6)
    cases = [
        torch.randn(5000, generator=gen),
        torch.randint(-3, 4, (5000,), generator=gen).float(),  # many ties at the threshold
        torch.cat([torch.zeros(4990), torch.randn(10, generator=gen)]),  # fewer nonzeros than k
    ]
    cases[0][17] = float("nan")
    for acc in cases:
        mag = torch.nan_to_num(acc.abs().double(), nan=float("inf")).tolist()
        order = sorted(range(acc.numel()), key=lambda i: (-mag[i], i))
        for k in (1, 50, 123, 4999):
            work = acc.clone()
            values, idx = topk_select(work, k, exact=exact, sample=256, seed=k)
            assert idx.dtype == torch.int32 and values.numel() == idx.numel() == k
            assert idx.tolist() == sorted(order[:k])
            assert torch.equal(values.nan_to_num(7.0), acc[idx.long()].nan_to_num(7.0))
            rest = torch.ones(acc.numel(), dtype=torch.bool)
            rest[idx.long()] = False
            assert torch.equal(work[rest], acc[rest]) and bool((work[idx.long()] == 0).all())


def test_topk_edge_cases():
    acc = torch.randn(10)
    values, idx = topk_select(acc.clone(), 0)
    assert values.numel() == 0 and idx.dtype == torch.int32
    work = acc.clone()
    values, idx = topk_select(work, 10)
    assert torch.equal(values, acc) and torch.equal(work, torch.zeros(10))
    with pytest.raises(ValueError, match="k=11"):
        topk_select(acc.clone(), 11)
    half = acc.half()
    values, idx = topk_select(half, 3)
    assert values.dtype == torch.float16 and torch.equal(idx.long(), acc.half().float().abs().topk(3).indices.sort().values)


def test_topk_lowers_a_threshold_that_was_too_high(monkeypatch):
    """With the sample aimed at far too few candidates the search must widen and still be exact."""
    import commpress.kernels.topk as topk_module

    monkeypatch.setattr(topk_module, "_SLACK", 1e-4)
    acc = torch.randn(20000, generator=torch.Generator().manual_seed(11))
    _, idx = topk_select(acc.clone(), 500, sample=2000)
    assert torch.equal(idx.long(), acc.abs().topk(500).indices.sort().values)


def test_scatter_add_decode_adds_ranks_in_order():
    gen = torch.Generator().manual_seed(8)
    world, n, k = 3, 300, 40
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(world)]).to(torch.int32)
    values = torch.randn(world, k, generator=gen)
    dense = torch.zeros(world, n)
    for r in range(world):
        dense[r, idx[r].long()] = values[r]
    expect = (dense[0] + dense[1] + dense[2]) / world
    out = torch.full((n,), 5.0)
    assert scatter_add_decode(values, idx, n, out) is out
    assert torch.equal(out, expect)
    scatter_add_decode(values, idx, n, out, average=False)
    assert torch.equal(out, dense[0] + dense[1] + dense[2])
    low = torch.empty(n, dtype=torch.bfloat16)
    assert torch.equal(scatter_add_decode(values, idx, n, low), expect.bfloat16())
    with pytest.raises(ValueError, match="indices"):
        scatter_add_decode(values, idx + n, n, out)


def test_error_feedback_round_trip():
    gen = torch.Generator().manual_seed(10)
    grad = torch.randn(100, generator=gen).bfloat16()
    error = torch.randn(100, generator=gen)
    acc = add_error(grad, error)
    assert acc.dtype == torch.float32 and torch.equal(acc, grad.float() + error)
    decoded = torch.randn(100, generator=gen)
    assert update_error(acc, decoded, error) is error
    assert torch.equal(error, acc - decoded)
    add_error(grad, error, out=error)
    assert torch.equal(error, grad.float() + (acc - decoded))
    with pytest.raises(TypeError, match="error"):
        add_error(grad, error.half())


def test_default_sample_grows_with_the_tensor_and_changes_no_result():
    from commpress.kernels.topk import default_sample

    assert [default_sample(n) for n in (10, 1 << 20, 1 << 22, 1 << 30)] == [4096, 4096, 16384, 32768]
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(3))
    picks = [
        topk_select(x.clone(), 2000, exact=exact, sample=sample, seed=5)
        for exact, sample in ((True, None), (False, None), (False, 4096))
    ]
    for values, indices in picks[1:]:
        assert torch.equal(values, picks[0][0]) and torch.equal(indices, picks[0][1])
