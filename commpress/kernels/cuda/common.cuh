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

__device__ __forceinline__ float cp_uniform(u64 seed, u64 i) { return cp_draw_to_uniform(cp_draw32(seed, i)); }

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
    if (dtype == CP_F16) return cp_half_to_float(h);
    return __uint_as_float(((u32)h) << 16);
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

#endif  // COMMPRESS_COMMON_CUH
