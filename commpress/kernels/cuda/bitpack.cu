// Bit packing: code j of a byte at bits j*b .. j*b+b-1 (b in 1, 2, 4, 8).
#include "common.cuh"

// The PER codes at p as one little-endian word: one load where p is aligned for it.
template <int PER>
__device__ __forceinline__ u64 cp_codes(const u8* p) {
    if constexpr (PER == 8) {
        if (((u64)p & 7) == 0) {
            const uint2 q = *(const uint2*)p;
            return (u64)q.x | ((u64)q.y << 32);
        }
    } else if constexpr (PER == 4) {
        if (((u64)p & 3) == 0) return *(const u32*)p;
    } else if constexpr (PER == 2) {
        if (((u64)p & 1) == 0) return *(const u16*)p;
    }
    u64 w = 0;
#pragma unroll
    for (int t = 0; t < PER; ++t) w |= (u64)p[t] << (8 * t);
    return w;
}

// One unit per output byte; BITS a template argument so a byte's work is unrolled.
template <int BITS>
__device__ __forceinline__ void cp_pack_bits_t(const u8* codes, u8* out, i64 n) {
    constexpr int PER = 8 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const i64 m = (n * BITS + 7) / 8, full = n / PER;
    CP_PASSES(base, stride, m) {
        u64 in[CP_UNROLL];
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 j = base + u * stride;
            if (j < full) {
                in[u] = cp_codes<PER>(codes + j * PER);
            } else {
                in[u] = 0;
#pragma unroll
                for (int t = 0; t < PER; ++t)
                    if (j * PER + t < n) in[u] |= (u64)codes[j * PER + t] << (8 * t);
            }
        }
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 j = base + u * stride;
            if (j >= m) break;
            u32 byte = 0;
#pragma unroll
            for (int t = 0; t < PER; ++t) byte |= ((u32)(in[u] >> (8 * t)) & MASK) << (t * BITS);
            out[j] = (u8)byte;
        }
    }
}

extern "C" __global__ void cp_pack_bits(const u8* codes, u8* out, i64 n, int bits) {
    switch (bits) {
        case 1: cp_pack_bits_t<1>(codes, out, n); break;
        case 2: cp_pack_bits_t<2>(codes, out, n); break;
        case 4: cp_pack_bits_t<4>(codes, out, n); break;
        default: cp_pack_bits_t<8>(codes, out, n); break;
    }
}

// One unit per code.
extern "C" __global__ void cp_unpack_bits(const u8* packed, u8* out, i64 n, int bits) {
    const u32 mask = (1u << bits) - 1u;
    CP_PASSES(base, stride, n) {
        u32 in[CP_UNROLL];
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 i = base + u * stride;
            in[u] = i < n ? (u32)packed[(i * bits) >> 3] : 0u;
        }
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 i = base + u * stride;
            if (i < n) out[i] = (u8)((in[u] >> ((i * bits) & 7)) & mask);
        }
    }
}
