// Uniform floats and sample indices from the counter-based generator (see common.cuh).
#include "common.cuh"

// One unit per generator word: draws offset + i of the stream, so word w serves the element
// pair (2w, 2w + 1) - offset, each stored where it falls inside [0, n).
extern "C" __global__ void cp_uniform_kernel(float* out, i64 n, u64 seed, u64 offset) {
    const u64 first = offset >> 1;
    const i64 words = (i64)(((offset + (u64)n - 1) >> 1) - first + 1);
    CP_PASSES(base, stride, words) {
#pragma unroll
        for (int u = 0; u < CP_UNROLL; ++u) {
            const i64 w = base + u * stride;
            if (w >= words) break;
            const u64 z = cp_word(seed, first + (u64)w);
            const i64 i = (i64)((first + (u64)w) * 2 - offset);  // the element of the low half (-1 before the first)
            const float pair[2] = {cp_draw_to_uniform((u32)z), cp_draw_to_uniform((u32)(z >> 32))};
            if (i >= 0 && i + 1 < n) {
                cp_store_run<2>(out, CP_F32, i, pair);
            } else {
                if (i >= 0) out[i] = pair[0];
                if (i + 1 < n) out[i + 1] = pair[1];
            }
        }
    }
}

// index j = floor(draw_j * n / 2^32): `count` positions in [0, n) for the top-k threshold sample.
extern "C" __global__ void cp_sample_indices(i64* out, i64 count, u64 seed, i64 n) {
    CP_GRID_STRIDE(j, count) { out[j] = (i64)(((u64)cp_draw32(seed, (u64)j) * (u64)n) >> 32); }
}
