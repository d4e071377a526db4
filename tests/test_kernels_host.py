"""The CUDA kernels' logic on this machine: each ``.cu`` is compiled as plain C++ (blocks of one
thread, run one after another; a small shim stands in for the CUDA built-ins; a warp shuffle
of one thread returns its own value) and driven through the real CUDA
front-ends of ``commpress/kernels/cuda/_launch.py`` with CPU tensors, then compared with the CPU
kernels bit for bit. This checks indexing, packing, rounding order and the launchers' argument
lists without a GPU; the real-device comparison is ``test_cuda_kernels.py``."""

import ctypes
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import kernel_oracle
import numpy as np
import pytest
import torch

import commpress.kernels as cc
from commpress.kernels.cuda import _cupy, _launch

CXX = shutil.which("g++") or shutil.which("c++")

GRID = 3  # blocks per launch: the grid-stride loops take more than one pass over small inputs

SHIM = r"""
#include <cmath>
#include <cstring>
#include <immintrin.h>
#define CP_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct cp_dim3 { unsigned int x; };
extern "C" { cp_dim3 blockIdx = {0}; }  // set by the launcher before each block's call
static const cp_dim3 threadIdx = {0}, blockDim = {1}, gridDim = {%d};
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static inline void __syncthreads() {}
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float atomicAdd(float* p, float v) { float old = *p; *p = old + v; return old; }
static inline unsigned atomicOr(unsigned* p, unsigned v) { unsigned old = *p; *p = old | v; return old; }
"""

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """module name -> ctypes library of that kernel source compiled for the host."""
    folder = tmp_path_factory.mktemp("host_kernels")
    (folder / "shim.h").write_text(SHIM % GRID)
    cmd = [CXX, "-O1", "-std=c++17", "-ffp-contract=off", "-mf16c", "-shared", "-fPIC", "-include", str(folder / "shim.h")]
    jobs = {}
    for name in ("rng", "bitpack", "ternary", "quantize", "topk", "stats", "sign"):  # compiled concurrently
        src = folder / f"{name}.cpp"
        src.write_text(_cupy.source(name))
        jobs[name] = subprocess.Popen([*cmd, "-o", str(folder / f"lib{name}.so"), str(src)], stderr=subprocess.PIPE, text=True)
    errors = {name: job.communicate()[1] for name, job in jobs.items() if job.wait() != 0}
    assert not errors, errors
    libs = {name: ctypes.CDLL(str(folder / f"lib{name}.so")) for name in jobs}
    return libs


_CTYPES = {np.int64: ctypes.c_longlong, np.uint64: ctypes.c_ulonglong, np.int32: ctypes.c_int, np.float32: ctypes.c_float}


@pytest.fixture
def on_host(host_kernels, monkeypatch):
    """Route _launch's kernel launches to the host-compiled kernels."""

    def launch(module, function, device, work, args, block=256, grid=None):
        if work <= 0:
            return
        converted = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else _CTYPES[type(a)](a.item()) for a in args]
        lib = host_kernels[module]
        block = ctypes.c_uint.in_dll(lib, "blockIdx")
        for index in range(GRID):
            block.value = index
            getattr(lib, function)(*converted)

    monkeypatch.setattr(_launch, "launch", launch)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():  # compare bit patterns: NaN == NaN, -0 != +0
        as_int = torch.int16 if a.element_size() == 2 else torch.int32
        a, b = a.view(as_int), b.view(as_int)
    return torch.equal(a, b)


def data(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 10.0, n)
    if n > 10:
        x[3], x[4] = 0.0, -0.0
        x[5:9] = 1.5  # exact ties
    return x.to(dtype)


SIZES = [1, 7, 1000, 5003]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_launchers_size_grids_by_the_kernels_constants():
    """The grids assume the units per thread that the sources take: UNROLL and SPAN are theirs."""
    for name, constant, value in (("common.cuh", "CP_UNROLL", _launch.UNROLL), ("quantize.cu", "CP_SPAN", _launch.SPAN)):
        text = (Path(_cupy.__file__).parent / name).read_text()
        assert re.search(rf"^#define {constant} (\d+)\b", text, re.MULTILINE).group(1) == str(value), name


def test_rng_and_bitpack(on_host):
    cpu = torch.device("cpu")
    for n in SIZES:
        for offset in (0, 1, 77):
            assert same_bits(_launch.uniform(9, n, offset, cpu), cc.uniform(9, n, offset))
        for bits, shift in ((1, 0), (2, 1), (4, 0), (8, 1), (2, 0), (1, 3)):
            codes = torch.randint(0, 256, (n + shift,), dtype=torch.uint8)[shift:]  # shift: not word-aligned
            packed = _launch.pack_bits(codes, bits)
            assert same_bits(packed, cc.pack_bits(codes, bits))
            assert same_bits(_launch.unpack_bits(packed, bits, n), cc.unpack_bits(packed, bits, n))
    idx = _launch.sample_indices(5, 100, 12345, cpu)
    draws = torch.from_numpy(kernel_oracle.bits32(5, 100).astype(np.int64))
    assert torch.equal(idx, (draws * 12345) >> 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary(on_host, dtype):
    for n, (world, shift) in itertools.product(SIZES, ((3, 0), (2, 1), (4, 0))):  # shift: unaligned tensors
        xs = [data(n + shift, dtype, r)[shift:] for r in range(world)]
        scales = torch.stack([x.float().abs().max() for x in xs])
        ours = torch.stack(
            [_launch.ternary_quantize_pack(x, s, cc.derive_seed(1, r)) for r, (x, s) in enumerate(zip(xs, scales))]
        )
        want = torch.stack([cc.ternary_quantize_pack(x, s, cc.derive_seed(1, r)) for r, (x, s) in enumerate(zip(xs, scales))])
        assert same_bits(ours, want)
        out, ref = torch.empty(n + shift, dtype=dtype)[shift:], torch.empty(n, dtype=dtype)
        _launch.ternary_unpack_accumulate(ours, scales, n, out)
        assert same_bits(out, cc.ternary_unpack_accumulate(want, scales, n, ref))
    assert not _launch.ternary_quantize_pack(data(100), torch.tensor(0.0), 1).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize(on_host, dtype):
    layouts = itertools.product(((2, 0), (3, 1)), (2, 4, 8), SIZES, (1, 37, 512))  # shift 1: unaligned tensors
    for (world, shift), bits, n, bucket in layouts:
        xs = [data(n + shift, dtype, r)[shift:] for r in range(world)]
        if n > 200:
            xs[0][74:111] = 0.5  # a constant bucket when bucket == 37
            xs[1][600] = float("nan")
        ours = [_launch.quantize_pack(x, bits, bucket, cc.derive_seed(2, r)) for r, x in enumerate(xs)]
        want = [cc.quantize_pack(x, bits, bucket, cc.derive_seed(2, r)) for r, x in enumerate(xs)]
        for o, w in zip(ours, want):
            assert same_bits(o[0], w[0])
            assert torch.equal(o[1].nan_to_num(9.0), w[1].nan_to_num(9.0))  # NaN bits are unspecified
            assert torch.equal(o[2].nan_to_num(9.0), w[2].nan_to_num(9.0))
        packed, mins, scales = (torch.stack(p) for p in zip(*want))
        for average in (True, False):
            out, ref = torch.empty(n + shift, dtype=dtype)[shift:], torch.empty(n, dtype=dtype)
            _launch.unpack_accumulate(packed, mins, scales, bits, bucket, n, out, average)
            cc.unpack_accumulate(packed, mins, scales, bits, bucket, n, ref, average=average)
            assert torch.equal(out.float().nan_to_num(9.0), ref.float().nan_to_num(9.0))
            assert same_bits(out[~ref.isnan()], ref[~ref.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_compaction_and_scatter(on_host, dtype):
    world, n, k = 3, 5003, 97
    accs = [data(n, dtype, r) for r in range(world)]
    picked = []
    for acc in accs:
        ours_acc, want_acc = acc.clone(), acc.clone()
        values, idx = cc.topk_select(want_acc, k)
        got_values, got_idx = _launch.gather_and_zero(ours_acc, idx.long())
        assert same_bits(got_values, values) and torch.equal(got_idx, idx) and same_bits(ours_acc, want_acc)
        picked.append((values, idx))
    values, idx = (torch.stack(p) for p in zip(*picked))
    for average in (True, False):
        out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        _launch.scatter_add_decode(values, idx, n, out, average)
        assert same_bits(out, cc.scatter_add_decode(values, idx, n, ref, average=average))
    bad = idx.clone()
    bad[1, 5], bad[2, 0] = n, -1  # skipped by the CUDA decode (the CPU's raises)
    kept = torch.ones_like(values, dtype=torch.bool)
    kept[1, 5] = kept[2, 0] = False
    out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    _launch.scatter_add_decode(values, bad, n, out, False)
    assert same_bits(out, cc.scatter_add_decode(torch.where(kept, values, 0), torch.where(kept, idx, 0), n, ref, average=False))


def test_topk_selection_of_the_cuda_path(on_host, monkeypatch):
    """The front end's selection with the CUDA implementation (torch ops around the sample's
    indices and the compaction kernel) picks the oracle's entries, sampled or exact."""
    monkeypatch.setattr("commpress.kernels.topk._device", lambda flat: _launch)
    for n, k in ((5003, 97), (70000, 700), (70000, 1)):
        acc = data(n, seed=n)
        acc[11] = float("nan")
        for exact in (False, True):
            ours, want = acc.clone(), acc.clone()
            values, idx = cc.topk_select(ours, k, exact=exact, seed=3)
            want_values, want_idx = kernel_oracle.topk_select(want, k)
            assert same_bits(values, want_values) and torch.equal(idx, want_idx) and same_bits(ours, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_span_stats(on_host, dtype):
    x = data(3 * 16384 + 5003, dtype)
    x[16400 + 20000] = float("nan")
    spans = [(0, 0), (1, 7), (10, 16384 + 3), (16400, 2 * 16384 + 600), (9, 1)]
    offsets, lengths = (np.array(v, np.int64) for v in zip(*spans))
    peak, sumsq = _launch.span_stats(x, offsets, lengths)
    want_peak, want_sumsq = cc.span_stats(x, spans)
    assert same_bits(peak, want_peak) and same_bits(sumsq.view(torch.int64), want_sumsq.view(torch.int64))
    assert torch.isnan(peak[3]) and torch.isnan(sumsq[3]) and peak[0] == 0 and sumsq[0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign(on_host, dtype):
    """Codes, sums of magnitudes (the stats lane and total passes with null peaks), acc, then
    the decode and residual of three ranks."""
    world, n = 3, 3 * 16384 + 5003
    spans = [(0, 0), (1, 7), (10, 16384 + 3), (16400, 2 * 16384 + 600), (9, 1)]
    offsets, lengths = (np.array(v, np.int64) for v in zip(*spans))
    payloads, accs = [], []
    for r in range(world):
        x, error = data(n, dtype, r), data(n, torch.float32, 10 + r)
        if r == 1:
            x[16400 + 20000] = float("nan")
        acc, want_acc = torch.full((n,), 3.0), torch.full((n,), 3.0)
        packed, totals = _launch.sign_pack(x, offsets, lengths, error if r else None, acc if r else None)
        want_packed, want_scales = cc.sign_pack_many(x, spans, error if r else None, want_acc if r else None)
        numel = torch.from_numpy(np.maximum(lengths, 1).astype(np.float64))
        assert same_bits(packed, want_packed) and same_bits((totals / numel).float(), want_scales) and same_bits(acc, want_acc)
        payloads.append((packed, want_scales))
        accs.append(acc)
    packed, scales = (torch.stack(p) for p in zip(*payloads))
    assert scales[1, 3].isnan() and scales[0, 0] == 0
    for rank in (0, 2):
        out, ref = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        residual, want_residual = accs[rank].clone(), accs[rank].clone()
        _launch.sign_decode(packed, scales, offsets, lengths, out, residual, rank)
        cc.sign_unpack_accumulate_many(packed, scales, spans, ref, want_residual, rank)
        assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().any()  # a NaN's bits are not specified
        assert same_bits(out[~ref.isnan()], ref[~ref.isnan()]) and same_bits(residual, want_residual)
    out, ref = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    _launch.sign_decode(packed, scales, offsets, lengths, out, None, 0)
    cc.sign_unpack_accumulate_many(packed, scales, spans, ref)
    assert same_bits(out[~ref.isnan()], ref[~ref.isnan()])
