// b-bit bucketed stochastic quantization (b in 2, 4, 8): per-bucket min/scale, codes + pack,
// and the fused unpack + dequantize + accumulate over ranks. Mirrors commpress/kernels/quantize.py.
#include "common.cuh"

#define CP_MINMAX_THREADS 256

// NaN-propagating min/max (as numpy's min/max): any NaN in the bucket makes the result NaN.
__device__ __forceinline__ float cp_nanmin(float a, float b) { return a != a ? a : (b != b ? b : fminf(a, b)); }
__device__ __forceinline__ float cp_nanmax(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

// One block per bucket (grid-stride over buckets); launch with CP_MINMAX_THREADS threads.
extern "C" __global__ void cp_bucket_minmax(const void* x, int dtype, i64 n, i64 bucket, float levels, float* mins,
                                            float* scales) {
    __shared__ float smin[CP_MINMAX_THREADS];
    __shared__ float smax[CP_MINMAX_THREADS];
    const i64 nb = (n + bucket - 1) / bucket;
    for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
        const i64 start = b * bucket;
        const i64 stop = start + bucket < n ? start + bucket : n;
        float lo = cp_load(x, dtype, start), hi = lo;
        for (i64 e = start + threadIdx.x; e < stop; e += blockDim.x) {
            float v = cp_load(x, dtype, e);
            lo = cp_nanmin(lo, v);
            hi = cp_nanmax(hi, v);
        }
        smin[threadIdx.x] = lo;
        smax[threadIdx.x] = hi;
        __syncthreads();
        for (int width = blockDim.x / 2; width > 0; width /= 2) {
            if (threadIdx.x < width) {
                smin[threadIdx.x] = cp_nanmin(smin[threadIdx.x], smin[threadIdx.x + width]);
                smax[threadIdx.x] = cp_nanmax(smax[threadIdx.x], smax[threadIdx.x + width]);
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            // + 0.0f turns -0 into +0, so the stored bits do not depend on the reduction order.
            float l = __fadd_rn(smin[0], 0.0f), h = __fadd_rn(smax[0], 0.0f);
            mins[b] = l;
            scales[b] = __fdiv_rn(__fsub_rn(h, l), levels);
        }
        __syncthreads();
    }
}

// q = clamp(floor((x - lo) / scale + u), 0, levels); NaN -> 0; scale 0 -> 0. Each thread packs a
// unit of whole bytes and whole generator words (2 elements for 8 bits, else one byte).
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
            const float s = scales[b];
            if (s != 0.0f) {
                float q = __fdiv_rn(__fsub_rn(cp_load(x, dtype, e), mins[b]), s);
                q = floorf(__fadd_rn(q, gen.at((u64)e)));
                q = fminf(fmaxf(q, 0.0f), levels);  // fmaxf maps NaN to 0
                byte |= ((u32)q) << ((t % per) * bits);
            }
            if ((t + 1) % per == 0) {
                out[(e * bits) >> 3] = (u8)byte;
                byte = 0;
            }
        }
    }
}

// out[i] = (sum over ranks, in order, of q * scale + lo) / world (if average), in float32.
extern "C" __global__ void cp_unpack_accumulate(const u8* packed, const float* mins, const float* scales, void* out, int dtype,
                                                i64 n, i64 m, i64 nb, i64 bucket, int bits, int world, int average) {
    const u32 mask = (1u << bits) - 1u;
    const bool narrow = n <= 0xFFFFFFFFLL && bucket <= 0xFFFFFFFFLL;  // 32-bit division is much cheaper
    CP_GRID_STRIDE(i, n) {
        const i64 bit = i * bits;
        const i64 b = narrow ? (i64)((u32)i / (u32)bucket) : i / bucket;
        float acc = 0.0f;
        for (int r = 0; r < world; ++r) {
            u32 q = (packed[r * m + (bit >> 3)] >> (bit & 7)) & mask;
            float v = __fadd_rn(__fmul_rn((float)q, scales[r * nb + b]), mins[r * nb + b]);
            acc = r == 0 ? v : __fadd_rn(acc, v);
        }
        if (average && world > 1) acc = __fdiv_rn(acc, (float)world);
        cp_store(out, dtype, i, acc);
    }
}
