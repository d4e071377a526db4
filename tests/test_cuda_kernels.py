"""CUDA kernels against their CPU oracle, bit for bit. Runs only where a CUDA device exists."""

import pytest
import torch

import commpress.kernels as cc

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1000, 65536 + 13, 3_000_001]


def data(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 10.0, n)
    if n > 10:
        x[3] = 0.0
        x[4] = -0.0
        x[5:9] = 1.5  # exact ties
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0 != +0), NaN where the other is NaN: a NaN's payload is not part of
    the kernels' contract (CUDA's float arithmetic returns its own canonical NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.masked_fill(nan, 0).view(as_int), b.masked_fill(nan, 0).view(as_int)
    return torch.equal(a, b)


@pytest.mark.parametrize("n", SIZES)
def test_uniform(n):
    for offset in (0, 1, 12345):
        assert same_bits(cc.uniform(77, n, offset, device="cuda"), cc.uniform(77, n, offset))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack(bits):
    for n in SIZES:
        shift = n % 2  # odd sizes: codes that start off a word boundary
        codes = torch.randint(0, 256, (n + shift,), dtype=torch.uint8)
        packed = cc.pack_bits(codes.cuda()[shift:], bits)
        codes = codes[shift:]
        assert same_bits(packed, cc.pack_bits(codes, bits))
        assert same_bits(cc.unpack_bits(packed, bits, n), cc.unpack_bits(packed.cpu(), bits, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary(dtype):
    for n in SIZES:
        world, shift = (2, 1) if n % 2 else (3, 0)  # odd sizes: unaligned tensors, a power-of-two world
        padded = [data(n + shift, dtype, r) for r in range(world)]
        xs = [x[shift:] for x in padded]
        scales = torch.stack([x.float().abs().max() for x in xs])
        gpu = torch.stack(
            [
                cc.ternary_quantize_pack(x.cuda()[shift:], s.cuda(), cc.derive_seed(1, r))
                for r, (x, s) in enumerate(zip(padded, scales))
            ]
        )
        cpu = torch.stack([cc.ternary_quantize_pack(x, s, cc.derive_seed(1, r)) for r, (x, s) in enumerate(zip(xs, scales))])
        assert same_bits(gpu, cpu)
        out_gpu = torch.empty(n + shift, dtype=dtype, device="cuda")[shift:]
        out_cpu = torch.empty(n, dtype=dtype)
        cc.ternary_unpack_accumulate(gpu, scales.cuda(), n, out_gpu)
        cc.ternary_unpack_accumulate(cpu, scales, n, out_cpu)
        assert same_bits(out_gpu, out_cpu)
    zero = cc.ternary_quantize_pack(data(100).cuda(), torch.zeros((), device="cuda"), 1)
    assert not zero.any()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize(bits, dtype):
    world = 2
    for n in SIZES:
        shift = n % 2  # odd sizes: unaligned tensors
        for bucket in (37, 512, 2048):
            padded = [data(n + shift, dtype, r) for r in range(world)]
            if n > 200:
                padded[0][100:150] = 0.5  # a constant bucket for bucket == 37
            xs = [x[shift:] for x in padded]
            gpu = [cc.quantize_pack(x.cuda()[shift:], bits, bucket, cc.derive_seed(2, r)) for r, x in enumerate(padded)]
            cpu = [cc.quantize_pack(x, bits, bucket, cc.derive_seed(2, r)) for r, x in enumerate(xs)]
            for g, c in zip(gpu, cpu):
                assert all(same_bits(a, b) for a, b in zip(g, c))
            stacked_gpu = [torch.stack(parts) for parts in zip(*gpu)]
            stacked_cpu = [torch.stack(parts) for parts in zip(*cpu)]
            for average in (True, False):
                out_gpu = torch.empty(n + shift, dtype=dtype, device="cuda")[shift:]
                out_cpu = torch.empty(n, dtype=dtype)
                cc.unpack_accumulate(*stacked_gpu, bits, bucket, n, out_gpu, average=average)
                cc.unpack_accumulate(*stacked_cpu, bits, bucket, n, out_cpu, average=average)
                assert same_bits(out_gpu, out_cpu)
            assert same_bits(cc.dequantize(*gpu[0], bits, bucket, n), cc.dequantize(*cpu[0], bits, bucket, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_and_scatter(dtype):
    world, n = 3, 1_000_003
    for exact in (False, True):
        accs = [data(n, dtype, r) for r in range(world)]
        gpu_acc = [a.cuda() for a in accs]
        k = 10_007
        gpu = [cc.topk_select(a, k, exact=exact, seed=r) for r, a in enumerate(gpu_acc)]
        cpu = [cc.topk_select(a, k, exact=exact, seed=r) for r, a in enumerate(accs)]
        for (gv, gi), (cv, ci), ga, ca in zip(gpu, cpu, gpu_acc, accs):
            assert same_bits(gv, cv) and same_bits(gi, ci) and same_bits(ga, ca)
        values_gpu, idx_gpu = (torch.stack(p) for p in zip(*gpu))
        values_cpu, idx_cpu = (torch.stack(p) for p in zip(*cpu))
        for average in (True, False):
            out_gpu = torch.empty(n, dtype=dtype, device="cuda")
            out_cpu = torch.empty(n, dtype=dtype)
            cc.scatter_add_decode(values_gpu, idx_gpu, n, out_gpu, average=average)
            cc.scatter_add_decode(values_cpu, idx_cpu, n, out_cpu, average=average)
            assert same_bits(out_gpu, out_cpu)


def test_error_feedback_and_device_errors():
    grad, error = data(1000, torch.bfloat16), data(1000, seed=1)
    acc_gpu = cc.add_error(grad.cuda(), error.cuda())
    assert same_bits(acc_gpu, cc.add_error(grad, error))
    with pytest.raises(ValueError, match="one device"):
        cc.add_error(grad, error.cuda())
    with pytest.raises(ValueError, match="one device"):
        cc.ternary_quantize_pack(grad.cuda(), torch.tensor(1.0), 0)


def test_kernels_run_on_the_current_stream():
    x = data(1 << 20).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.mul_(2.0)  # queued on the side stream; the kernel below must see its result
        packed, mins, scales = cc.quantize_pack(x, 8, 1024, 3)
    side.synchronize()
    want = cc.quantize_pack(data(1 << 20) * 2.0, 8, 1024, 3)
    assert all(same_bits(a, b) for a, b in zip((packed, mins, scales), want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_span_stats(dtype):
    x = data(3_000_001, dtype)
    x[2_000_000] = float("nan")
    spans = [(0, 0), (1, 7), (10, 65536 + 3), (100_000, 1_500_000), (1_600_000, 1_400_001)]
    peak, sumsq = cc.span_stats(x.cuda(), spans)
    want_peak, want_sumsq = cc.span_stats(x, spans)
    assert same_bits(peak, want_peak) and same_bits(sumsq, want_sumsq)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign(dtype):
    world, n = 3, 3_000_001
    spans = [(0, 0), (1, 7), (10, 65536 + 3), (100_000, 1_500_000), (1_600_000, 1_400_001)]
    gpu, cpu = [], []
    for r in range(world):
        x, error = data(n, dtype, r), data(n, torch.float32, 10 + r)
        acc = torch.empty(n)
        gpu_acc = acc.cuda()
        gpu.append((*cc.sign_pack_many(x.cuda(), spans, error.cuda(), gpu_acc), gpu_acc))
        cpu.append((*cc.sign_pack_many(x, spans, error, acc), acc))
        assert all(same_bits(a, b) for a, b in zip(gpu[-1], cpu[-1]))
    packed, scales = (torch.stack([p[i] for p in cpu]) for i in (0, 1))
    out, residual = torch.empty(n, dtype=dtype), cpu[1][2].clone()
    gpu_out, gpu_residual = out.cuda(), residual.cuda()
    cc.sign_unpack_accumulate_many(packed.cuda(), scales.cuda(), spans, gpu_out, gpu_residual, 1)
    cc.sign_unpack_accumulate_many(packed, scales, spans, out, residual, 1)
    assert same_bits(gpu_out, out) and same_bits(gpu_residual, residual)
