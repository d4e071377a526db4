// Uniform floats and sample indices from the counter-based generator (see common.cuh).
#include "common.cuh"

extern "C" __global__ void cp_uniform_kernel(float* out, i64 n, u64 seed, u64 offset) {
    CP_GRID_STRIDE(i, n) { out[i] = cp_uniform(seed, offset + (u64)i); }
}

// index j = floor(draw_j * n / 2^32): `count` positions in [0, n) for the top-k threshold sample.
extern "C" __global__ void cp_sample_indices(i64* out, i64 count, u64 seed, i64 n) {
    CP_GRID_STRIDE(j, count) { out[j] = (i64)(((u64)cp_draw32(seed, (u64)j) * (u64)n) >> 32); }
}
