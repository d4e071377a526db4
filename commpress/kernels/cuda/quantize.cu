// b-bit bucketed stochastic quantization (b in 2, 4, 8): per-bucket min/scale, codes + pack,
// and the fused unpack + dequantize + accumulate over ranks. Mirrors commpress/kernels/quantize.py.
#include "common.cuh"

#define CP_FULL_WARP 0xFFFFFFFFu
#define CP_SPAN 8  // elements (a blockDim apart) a thread of cp_bucket_quantize reads at a time for the min/max

// NaN-propagating min/max (as numpy's min/max): any NaN in the bucket makes the result NaN.
__device__ __forceinline__ float cp_nanmin(float a, float b) { return a != a ? a : (b != b ? b : fminf(a, b)); }
__device__ __forceinline__ float cp_nanmax(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

// q = clamp(floor((v - lo) / scale + u), 0, levels); NaN -> 0; scale 0 -> 0.
__device__ __forceinline__ u32 cp_quantize_one(float v, float lo, float s, float levels, float u) {
    if (s == 0.0f) return 0u;
    float q = __fdiv_rn(__fsub_rn(v, lo), s);
    q = floorf(__fadd_rn(q, u));
    return (u32)fminf(fmaxf(q, 0.0f), levels);  // fmaxf maps NaN to 0
}

// One block per bucket (grid-stride over buckets), blockDim a multiple of 32: the bucket's min
// and scale, then (if `pack`: the bucket's codes fill whole bytes) its packed codes, from the
// same block while the bucket is still in its cache. The min/max pass gives each thread CP_SPAN
// elements a blockDim apart (loads in flight, consecutive across a warp), the packing pass
// CP_UNROLL output bytes.
template <int BITS>
__device__ __forceinline__ void cp_bucket_quantize_t(const void* x, int dtype, i64 n, i64 bucket, float* mins, float* scales,
                                                     u8* out, u64 seed, int pack) {
    constexpr int PER = 8 / BITS;
    const float levels = (float)((1 << BITS) - 1);
    __shared__ float part_lo[32], part_hi[32];
    __shared__ float bucket_lo, bucket_scale;
    const i64 nb = (n + bucket - 1) / bucket;
    for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
        const i64 start = b * bucket;
        const i64 stop = start + bucket < n ? start + bucket : n;
        const float first = cp_load(x, dtype, start);
        float lo = first, hi = first;
        for (i64 e0 = start + threadIdx.x; e0 < stop; e0 += (i64)blockDim.x * CP_SPAN) {
            float v[CP_SPAN];
#pragma unroll
            for (int t = 0; t < CP_SPAN; ++t) {
                const i64 e = e0 + (i64)t * blockDim.x;
                v[t] = e < stop ? cp_load(x, dtype, e) : first;
            }
#pragma unroll
            for (int t = 0; t < CP_SPAN; ++t) {
                lo = cp_nanmin(lo, v[t]);
                hi = cp_nanmax(hi, v[t]);
            }
        }
        for (int d = 16; d > 0; d /= 2) {
            lo = cp_nanmin(lo, __shfl_xor_sync(CP_FULL_WARP, lo, d));
            hi = cp_nanmax(hi, __shfl_xor_sync(CP_FULL_WARP, hi, d));
        }
        if ((threadIdx.x & 31) == 0) {
            part_lo[threadIdx.x >> 5] = lo;
            part_hi[threadIdx.x >> 5] = hi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32 w = 1; w < (blockDim.x + 31) / 32; ++w) {
                lo = cp_nanmin(lo, part_lo[w]);
                hi = cp_nanmax(hi, part_hi[w]);
            }
            // + 0.0f turns -0 into +0, so the stored bits do not depend on the reduction order.
            const float l = __fadd_rn(lo, 0.0f), h = __fadd_rn(hi, 0.0f);
            mins[b] = bucket_lo = l;
            scales[b] = bucket_scale = __fdiv_rn(__fsub_rn(h, l), levels);
        }
        __syncthreads();
        if (pack) {
            const float l = bucket_lo, s = bucket_scale;
            const i64 last = (stop + PER - 1) / PER;  // the bucket's bytes: [start / PER, last)
            cp_uniforms gen(seed);
            for (i64 j0 = start / PER + threadIdx.x; j0 < last; j0 += (i64)blockDim.x * CP_UNROLL) {
                float v[CP_UNROLL][PER];
#pragma unroll
                for (int u = 0; u < CP_UNROLL; ++u) cp_load_part<PER>(x, dtype, (j0 + (i64)u * blockDim.x) * PER, stop, v[u]);
#pragma unroll
                for (int u = 0; u < CP_UNROLL; ++u) {
                    const i64 j = j0 + (i64)u * blockDim.x;
                    if (j >= last) break;
                    u32 byte = 0;
#pragma unroll
                    for (int t = 0; t < PER; ++t) {
                        const i64 e = j * PER + t;
                        if (e < stop) byte |= cp_quantize_one(v[u][t], l, s, levels, gen.at((u64)e)) << (t * BITS);
                    }
                    out[j] = (u8)byte;
                }
            }
        }
        __syncthreads();  // the shared values are the next bucket's
    }
}

extern "C" __global__ void cp_bucket_quantize(const void* x, int dtype, i64 n, i64 bucket, int bits, float* mins,
                                              float* scales, u8* out, u64 seed, int pack) {
    switch (bits) {
        case 2: cp_bucket_quantize_t<2>(x, dtype, n, bucket, mins, scales, out, seed, pack); break;
        case 4: cp_bucket_quantize_t<4>(x, dtype, n, bucket, mins, scales, out, seed, pack); break;
        default: cp_bucket_quantize_t<8>(x, dtype, n, bucket, mins, scales, out, seed, pack); break;
    }
}

// The codes of buckets whose bytes straddle two buckets (bucket * bits not a multiple of 8), after
// cp_bucket_quantize's mins and scales. Each thread packs a unit of whole bytes and whole
// generator words (2 elements for 8 bits, else one byte).
extern "C" __global__ void cp_quantize_pack(const void* x, int dtype, const float* mins, const float* scales, u8* out, i64 n,
                                            i64 bucket, int bits, u64 seed) {
    const int per = 8 / bits;
    const int unit = per < 2 ? 2 : per;
    const float levels = (float)((1 << bits) - 1);
    const i64 units = (n + unit - 1) / unit;
    CP_GRID_STRIDE(j, units) {
        cp_uniforms gen(seed);
        const i64 first = j * unit;
        i64 b = first / bucket;       // one 64-bit division per unit;
        i64 next = (b + 1) * bucket;  // its elements may cross into the next bucket
        u32 byte = 0;
        for (int t = 0; t < unit; ++t) {
            const i64 e = first + t;
            if (e >= n) {
                if (t % per) out[((e - 1) * bits) >> 3] = (u8)byte;  // the partial last byte
                break;
            }
            if (e == next) {
                ++b;
                next += bucket;
            }
            byte |= cp_quantize_one(cp_load(x, dtype, e), mins[b], scales[b], levels, gen.at((u64)e)) << ((t % per) * bits);
            if ((t + 1) % per == 0) {
                out[(e * bits) >> 3] = (u8)byte;
                byte = 0;
            }
        }
    }
}

// out[i] = (sum over ranks, in order, of q * scale + lo) / world (`inverse`: see cp_average), in
// float32. One unit per element. (One unit per packed byte, with per-rank arrays for its codes,
// ran at a quarter of the occupancy and was slower on an H200: docs/kernels.md.)
extern "C" __global__ void cp_unpack_accumulate(const u8* packed, const float* mins, const float* scales, void* out, int dtype,
                                                i64 n, i64 m, i64 nb, i64 bucket, int bits, int world, float inverse) {
    const u32 mask = (1u << bits) - 1u;
    const bool narrow = n <= 0xFFFFFFFFLL && bucket <= 0xFFFFFFFFLL;  // 32-bit division is much cheaper
    CP_PASSES(base, stride, n) {
        i64 b[CP_UNROLL];
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 i = base + u * stride < n ? base + u * stride : n - 1;
            b[u] = narrow ? (i64)((u32)i / (u32)bucket) : i / bucket;
        }
        float acc[CP_UNROLL];
        for (int r = 0; r < world; ++r) {
            u32 byte[CP_UNROLL];
            float scale[CP_UNROLL], lo[CP_UNROLL];
#pragma unroll
            for (int u = 0; u < CP_UNROLL; ++u) {
                const i64 i = base + u * stride < n ? base + u * stride : n - 1;
                byte[u] = packed[r * m + ((i * bits) >> 3)];
                scale[u] = scales[r * nb + b[u]];
                lo[u] = mins[r * nb + b[u]];
            }
#pragma unroll
            for (int u = 0; u < CP_UNROLL; ++u) {
                const u32 q = (byte[u] >> (((base + u * stride) * bits) & 7)) & mask;
                const float v = __fadd_rn(__fmul_rn((float)q, scale[u]), lo[u]);
                acc[u] = r == 0 ? v : __fadd_rn(acc[u], v);
            }
        }
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 i = base + u * stride;
            if (i >= n) break;
            cp_store(out, dtype, i, cp_average(acc[u], inverse, world));
        }
    }
}
