// TernGrad: stochastic ternary quantize + pack (4 codes per byte), and the fused
// unpack + scale + accumulate over ranks + average. Mirrors commpress/kernels/ternary.py.
#include "common.cuh"

// One unit per output byte: elements 4j .. 4j+3, whose uniforms are generator words 2j and 2j+1.
// Code 1: +, code 2: -, 0: dropped; keep iff u < |x| / scale (never past n: those read as 0).
extern "C" __global__ void cp_ternary_quantize_pack(const void* x, int dtype, const float* scale, u8* out, i64 n, u64 seed) {
    const float s = *scale;
    const i64 m = (n + 3) / 4;
    CP_PASSES(base, stride, m) {
        float v[CP_UNROLL][4];
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) cp_load_part<4>(x, dtype, 4 * (base + u * stride), n, v[u]);
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 j = base + u * stride;
            if (j >= m) break;
            u32 byte = 0;
            if (s > 0.0f) {
                const u64 z[2] = {cp_word(seed, 2 * (u64)j), cp_word(seed, 2 * (u64)j + 1)};
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float p = __fdiv_rn(fabsf(v[u][t]), s);
                    if (cp_draw_to_uniform((u32)(z[t >> 1] >> ((t & 1) * 32))) < p)
                        byte |= (1u << (__float_as_uint(v[u][t]) >> 31)) << (2 * t);
                }
            }
            out[j] = (u8)byte;
        }
    }
}

// out[i] = (sum over ranks r, in order, of scales[r] * code_r(i)) / world, in float32 (`inverse`:
// see cp_average). One unit per packed byte: its four elements.
extern "C" __global__ void cp_ternary_unpack_accumulate(const u8* packed, const float* scales, void* out, int dtype, i64 n,
                                                        i64 m, int world, float inverse) {
    CP_PASSES(base, stride, m) {
        float acc[CP_UNROLL][4];
        for (int r = 0; r < world; ++r) {
            const u8* row = packed + r * m;
            const float s = scales[r];
            u32 byte[CP_UNROLL];
#pragma unroll
            for (int u = 0; u < CP_UNROLL; ++u) byte[u] = base + u * stride < m ? (u32)row[base + u * stride] : 0u;
#pragma unroll
            for (int u = 0; u < CP_UNROLL; ++u) {
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const u32 c = (byte[u] >> (2 * t)) & 3u;
                    const float v = c == 1u ? s : (c == 2u ? -s : 0.0f);
                    acc[u][t] = r == 0 ? v : __fadd_rn(acc[u][t], v);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 j = base + u * stride;
            if (j >= m) break;
#pragma unroll
            for (int t = 0; t < 4; ++t) acc[u][t] = cp_average(acc[u][t], inverse, world);
            cp_store_part<4>(out, dtype, 4 * j, n, acc[u]);
        }
    }
}
