// TernGrad: stochastic ternary quantize + pack (4 codes per byte), and the fused
// unpack + scale + accumulate over ranks + average. Mirrors commpress/kernels/ternary.py.
#include "common.cuh"

// One thread per output byte. Code 1: +, code 2: -, 0: dropped; keep iff u < |x| / scale.
extern "C" __global__ void cp_ternary_quantize_pack(const void* x, int dtype, const float* scale, u8* out, i64 n, u64 seed) {
    const float s = *scale;
    const i64 m = (n + 3) / 4;
    CP_GRID_STRIDE(j, m) {
        u32 byte = 0;
        if (s > 0.0f) {
            cp_uniforms gen(seed);
            for (int t = 0; t < 4; ++t) {
                i64 e = j * 4 + t;
                if (e >= n) break;
                float v = cp_load(x, dtype, e);
                float p = __fdiv_rn(fabsf(v), s);
                if (gen.at((u64)e) < p) byte |= (1u << (__float_as_uint(v) >> 31)) << (2 * t);
            }
        }
        out[j] = (u8)byte;
    }
}

// out[i] = (sum over ranks r, in order, of scales[r] * code_r(i)) / world, in float32.
extern "C" __global__ void cp_ternary_unpack_accumulate(const u8* packed, const float* scales, void* out, int dtype, i64 n,
                                                        i64 m, int world) {
    CP_GRID_STRIDE(i, n) {
        const int shift = (int)(i & 3) * 2;
        float acc = 0.0f;
        for (int r = 0; r < world; ++r) {
            u32 c = (packed[r * m + (i >> 2)] >> shift) & 3u;
            float s = scales[r];
            float v = c == 1u ? s : (c == 2u ? -s : 0.0f);
            acc = r == 0 ? v : __fadd_rn(acc, v);
        }
        if (world > 1) acc = __fdiv_rn(acc, (float)world);
        cp_store(out, dtype, i, acc);
    }
}
