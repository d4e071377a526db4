// Shared device code of the commpress kernels: the counter-based generator and float loads/stores.
// Compiled with --fmad=false and written with explicit _rn intrinsics so that every float
// operation is the single IEEE operation the CPU kernels (commpress/kernels/cpu/*.py) perform.
#ifndef COMMPRESS_COMMON_CUH
#define COMMPRESS_COMMON_CUH

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned char u8;
typedef unsigned short u16;

// dtype codes of float tensors, as in commpress/kernels/cuda/_launch.py
#define CP_F32 0
#define CP_F16 1
#define CP_BF16 2

#define CP_GRID_STRIDE(i, count) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (count); i += (i64)blockDim.x * gridDim.x)

// Units per thread in one pass of the streaming kernels (UNROLL in _launch.py, which sizes their grids).
// A pass reads all its units' inputs first, then computes and stores: a thread has that many units'
// loads in flight at once, where one load per thread left the memory system waiting on latency.
#define CP_UNROLL 4

// Grid-stride in passes of CP_UNROLL units: unit u of a pass is `base + u * stride`, so a warp's
// threads still touch consecutive units.
#define CP_PASSES(base, stride, count)                                                                       \
    for (i64 base = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)blockDim.x * gridDim.x; \
         base < (count); base += CP_UNROLL * stride)

// SplitMix64 in counter mode: word c of stream `seed`; draw i is the low (i even) or high half of word i/2.
__device__ __forceinline__ u64 cp_word(u64 seed, u64 c) {
    u64 z = seed + c * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u32 cp_draw32(u64 seed, u64 i) {
    u64 z = cp_word(seed, i >> 1);
    return (i & 1) ? (u32)(z >> 32) : (u32)z;
}

// Uniform in [0, 1) from the low 23 bits: the float in [1, 2) with that mantissa, minus 1 (exact).
__device__ __forceinline__ float cp_draw_to_uniform(u32 draw) {
    return __fsub_rn(__uint_as_float((draw & 0x7FFFFFu) | 0x3F800000u), 1.0f);
}


// Uniforms of consecutive elements: one word serves an even element and the odd one after it.
struct cp_uniforms {
    u64 seed, word, z;
    __device__ explicit cp_uniforms(u64 s) : seed(s), word(~0ULL), z(0) {}
    __device__ __forceinline__ float at(u64 i) {
        if ((i >> 1) != word) {
            word = i >> 1;
            z = cp_word(seed, word);
        }
        return cp_draw_to_uniform((i & 1) ? (u32)(z >> 32) : (u32)z);
    }
};

#ifdef CP_HOST_EMULATION  // tests/test_kernels_host.py runs these sources as C++ on the CPU
__device__ __forceinline__ float cp_half_to_float(u16 h) { return _cvtsh_ss(h); }
__device__ __forceinline__ u16 cp_float_to_half(float f) { return _cvtss_sh(f, 0); }  // 0: nearest even
#else
__device__ __forceinline__ float cp_half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 cp_float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Round to nearest even, NaN to 0x7FC0: the rounding torch uses for float -> bfloat16.
__device__ __forceinline__ u16 cp_float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)0x7FC0;
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float cp_load(const void* p, int dtype, i64 i) {
    if (dtype == CP_F32) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return dtype == CP_F16 ? cp_half_to_float(h) : __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ void cp_store(void* p, int dtype, i64 i, float v) {
    if (dtype == CP_F32) {
        ((float*)p)[i] = v;
    } else if (dtype == CP_F16) {
        ((u16*)p)[i] = cp_float_to_half(v);
    } else {
        ((u16*)p)[i] = cp_float_to_bf16(v);
    }
}

// The average's last step, x / world: `inverse` 1 when there is none, 1/world where that is a power
// of two (x * inverse is the same exact quotient, rounded once: the same bits as the division), 0
// for a division.
__device__ __forceinline__ float cp_average(float x, float inverse, int world) {
    return inverse == 1.0f ? x : (inverse != 0.0f ? __fmul_rn(x, inverse) : __fdiv_rn(x, (float)world));
}

__device__ __forceinline__ float cp_from16(u16 h, int dtype) {
    return dtype == CP_F16 ? cp_half_to_float(h) : __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 cp_to16(float v, int dtype) { return dtype == CP_F16 ? cp_float_to_half(v) : cp_float_to_bf16(v); }

// K consecutive 32-bit words at p, read (written) with 16- or 8-byte accesses where p is aligned
// for them, else one word at a time: fewer instructions in the streaming kernels, the same bits.
template <int K>
__device__ __forceinline__ void cp_load_words(const u32* p, u32* w) {
    if constexpr (K % 4 == 0) {
        if (((u64)p & 15) == 0) {
#pragma unroll
            for (int k = 0; k < K; k += 4) {
                const uint4 q = *(const uint4*)(p + k);
                w[k] = q.x, w[k + 1] = q.y, w[k + 2] = q.z, w[k + 3] = q.w;
            }
            return;
        }
    }
    if constexpr (K % 2 == 0) {
        if (((u64)p & 7) == 0) {
#pragma unroll
            for (int k = 0; k < K; k += 2) {
                const uint2 q = *(const uint2*)(p + k);
                w[k] = q.x, w[k + 1] = q.y;
            }
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) w[k] = p[k];
}

template <int K>
__device__ __forceinline__ void cp_store_words(u32* p, const u32* w) {
    if constexpr (K % 4 == 0) {
        if (((u64)p & 15) == 0) {
#pragma unroll
            for (int k = 0; k < K; k += 4) {
                uint4 q;
                q.x = w[k], q.y = w[k + 1], q.z = w[k + 2], q.w = w[k + 3];
                *(uint4*)(p + k) = q;
            }
            return;
        }
    }
    if constexpr (K % 2 == 0) {
        if (((u64)p & 7) == 0) {
#pragma unroll
            for (int k = 0; k < K; k += 2) {
                uint2 q;
                q.x = w[k], q.y = w[k + 1];
                *(uint2*)(p + k) = q;
            }
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = w[k];
}

// Elements e .. e+K-1 of a float tensor (K in 1, 2, 4, 8), as float32: vector accesses where the
// address allows (a 16-bit run as 32-bit words when 4-byte aligned), else cp_load per element.
template <int K>
__device__ __forceinline__ void cp_load_run(const void* x, int dtype, i64 e, float* v) {
    if (dtype == CP_F32) {
        u32 w[K];
        cp_load_words<K>((const u32*)((const float*)x + e), w);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = __uint_as_float(w[k]);
        return;
    }
    if constexpr (K % 2 == 0) {
        const u16* p = (const u16*)x + e;
        if (((u64)p & 3) == 0) {
            u32 w[K / 2];
            cp_load_words<K / 2>((const u32*)p, w);
#pragma unroll
            for (int k = 0; k < K; ++k) v[k] = cp_from16((u16)(w[k >> 1] >> ((k & 1) * 16)), dtype);
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = cp_load(x, dtype, e + k);
}

template <int K>
__device__ __forceinline__ void cp_store_run(void* out, int dtype, i64 e, const float* v) {
    if (dtype == CP_F32) {
        u32 w[K];
#pragma unroll
        for (int k = 0; k < K; ++k) w[k] = __float_as_uint(v[k]);
        cp_store_words<K>((u32*)((float*)out + e), w);
        return;
    }
    if constexpr (K % 2 == 0) {
        u16* p = (u16*)out + e;
        if (((u64)p & 3) == 0) {
            u32 w[K / 2];
#pragma unroll
            for (int k = 0; k < K; k += 2) w[k >> 1] = (u32)cp_to16(v[k], dtype) | ((u32)cp_to16(v[k + 1], dtype) << 16);
            cp_store_words<K / 2>((u32*)p, w);
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) cp_store(out, dtype, e + k, v[k]);
}

// The elements e .. e+K-1 that lie below `end` (the others read as 0, or are not written): a
// run's vector access where all of it does, one access each at a tensor's or bucket's tail.
template <int K>
__device__ __forceinline__ void cp_load_part(const void* x, int dtype, i64 e, i64 end, float* v) {
    if (e + K <= end) {
        cp_load_run<K>(x, dtype, e, v);
        return;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = e + k < end ? cp_load(x, dtype, e + k) : 0.0f;
}

template <int K>
__device__ __forceinline__ void cp_store_part(void* out, int dtype, i64 e, i64 end, const float* v) {
    if (e + K <= end) {
        cp_store_run<K>(out, dtype, e, v);
        return;
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
        if (e + k < end) cp_store(out, dtype, e + k, v[k]);
}

#endif  // COMMPRESS_COMMON_CUH
