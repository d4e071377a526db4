"""The compiled CPU kernels (numba) give the bits of the oracle (``kernel_oracle``).

Every op runs through :mod:`commpress.kernels` and through the oracle on odd sizes, stream
offsets, every bit width and dtype, special values (NaN, +-0, Inf, ties), on one thread and
on two (several spans per call). The CUDA kernels are compared with the CPU kernels in
``test_kernels_host.py`` (their sources on this machine) and ``test_cuda_kernels.py`` (a GPU).
"""

import pytest
import torch

import commpress.kernels as cc
from commpress.kernels.cpu._chunks import CHUNK

SIZES = [1, 7, 1001, 2 * CHUNK + 13]  # the last one splits into several spans on two threads
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def same_bits(a, b) -> bool:
    """Equal bit patterns (NaN == NaN, -0 != +0), tensors or tuples of them."""
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = torch.int16 if a.element_size() == 2 else torch.int32
        a, b = a.view(as_int), b.view(as_int)
    return torch.equal(a, b)


def data(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 10.0, n)
    if n > 20:
        x[3], x[4], x[5] = 0.0, -0.0, float("nan")
        x[6:10] = 1.5  # exact ties
        x[11] = float("inf")
    return x.to(dtype)


def test_uniform(both, threads):
    for n in [0, *SIZES]:
        for offset in (0, 1, 77, 2**40 + 1):
            assert same_bits(*both(lambda ops: ops.uniform(123, n, offset)))  # noqa: B023


def test_pack_and_unpack(both, threads):
    for n in SIZES:
        codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        for bits in (1, 2, 4, 8):
            packed, packed_np = both(lambda ops: ops.pack_bits(codes, bits))  # noqa: B023
            assert same_bits(packed, packed_np)
            assert same_bits(*both(lambda ops: ops.unpack_bits(packed, bits, n)))  # noqa: B023


@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary(both, threads, dtype):
    for n in SIZES:
        x = data(n, 1, dtype)
        finite = x.float().nan_to_num(0.0, 0.0, 0.0)
        scale = finite.abs().max() * 0.9  # some elements above the scale: always kept
        for bound in (None, scale * 0.5, torch.tensor(0.0), torch.tensor(float("inf"))):
            assert same_bits(*both(lambda ops: ops.ternary_quantize_pack(x, scale, 77, bound)))  # noqa: B023
        world = 3
        packed = torch.stack([cc.ternary_quantize_pack(x, scale, r) for r in range(world)])
        scales = torch.tensor([scale.item(), 0.0, -2.5])
        for out_dtype in DTYPES:
            for w in (1, world):
                out = torch.empty(n, dtype=out_dtype)
                results = both(lambda ops: ops.ternary_unpack_accumulate(packed[:w], scales[:w], n, out.clone()))  # noqa: B023
                assert same_bits(*results)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize(both, threads, bits):
    for n in SIZES:
        for dtype in DTYPES:
            for bucket in (1, 3, 37, 1024):
                xs = [data(n, r, dtype) for r in range(3)]
                if n > 200:
                    xs[1][74:111] = 0.5  # constant buckets
                (p, lo, sc), (p_np, lo_np, sc_np) = both(lambda ops: ops.quantize_pack(xs[0], bits, bucket, 5))  # noqa: B023
                assert same_bits(p, p_np)
                for a, b in ((lo, lo_np), (sc, sc_np)):  # the bits of a NaN are unspecified
                    assert same_bits(a.nan_to_num(9.0), b.nan_to_num(9.0))
                payloads = [cc.quantize_pack(x, bits, bucket, r) for r, x in enumerate(xs)]
                packed, mins, scales = (torch.stack(t) for t in zip(*payloads))
                for average in (True, False):
                    for w in (1, 3):

                        def decode(ops, w=w, average=average, bucket=bucket, packed=packed, mins=mins, scales=scales, n=n):
                            out = torch.empty(n)
                            return ops.unpack_accumulate(packed[:w], mins[:w], scales[:w], bits, bucket, n, out, average=average)

                        out = both(decode)
                        assert same_bits(out[0].nan_to_num(9.0), out[1].nan_to_num(9.0))
                        assert same_bits(out[0][~out[1].isnan()], out[1][~out[1].isnan()])


@pytest.mark.parametrize("exact", [False, True])
def test_topk(both, threads, exact):
    gen = torch.Generator().manual_seed(4)
    n = SIZES[-1]
    cases = [
        data(n, 2),
        torch.randint(-3, 4, (n,), generator=gen).float(),  # many ties
        torch.ones(n),  # every entry a candidate: the buffers overflow and are refilled
        torch.zeros(n),
        data(n, 3, torch.float16),
    ]
    for acc in cases:
        for k in (1, 97, n // 100, n - 1):

            def select(ops, acc=acc, k=k):
                work = acc.clone()
                values, idx = ops.topk_select(work, k, exact=exact, seed=k)
                return values, idx, work

            assert same_bits(*both(select))


def test_scatter_add_decode(both, threads):
    gen = torch.Generator().manual_seed(5)
    n, k, world = SIZES[-1], 3001, 3
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(world)]).to(torch.int32)  # shared across ranks
    values = torch.randn(world, k, generator=gen)
    values[1, 7] = -0.0
    for out_dtype in DTYPES:
        for average in (True, False):
            for w in (1, world):

                def decode(ops, w=w, average=average, out_dtype=out_dtype):
                    return ops.scatter_add_decode(values[:w], idx[:w], n, torch.full((n,), 5.0, dtype=out_dtype), average=average)

                assert same_bits(*both(decode))
    halves = values.half()
    assert same_bits(*both(lambda ops: ops.scatter_add_decode(halves, idx, n, torch.empty(n))))


def test_ternary_bound_must_be_a_number_at_least_zero():
    x = torch.randn(16)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=rf"bound must be a number >= 0 \(inf: no clipping\), got {bad}"):
            cc.ternary_quantize_pack(x, torch.tensor(1.0), 0, torch.tensor(bad))
    with pytest.raises(TypeError, match="bound"):
        cc.ternary_quantize_pack(x, torch.tensor(1.0), 0, torch.tensor(1.0, dtype=torch.float64))
