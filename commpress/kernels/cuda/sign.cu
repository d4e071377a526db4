// 1-bit sign codes with a float32 scale per tensor: a = x (+ error), its signs packed 8 per byte
// and the float64 lane sums of |a| in span_stats' chunk order (finished by stats.cu's lane and total
// passes), then the decode of every rank's codes fused with the residual. Mirrors
// commpress/kernels/sign.py. Chunk g holds elements [first[g], end[g]) of the buffer; its packed
// bytes start at byte_first[g].
#include "common.cuh"

// One thread per (chunk, byte column q < lanes / 8): lanes 8q .. 8q + 7 of every row of chunk g,
// so each thread owns whole bytes. Bit 1 where a < 0 (zeros, -0 and NaN are +). With feedback,
// a = x + error (float32) is also written to acc (which may be error itself).
extern "C" __global__ void cp_sign_pack_chunks(const void* x, int dtype, const float* error, float* acc, int feedback,
                                               const i64* first, const i64* end, const i64* byte_first, i64 chunks,
                                               i64 lanes, i64 rows, double* sums, u8* packed) {
    const i64 cols = lanes / 8;
    CP_GRID_STRIDE(w, chunks * cols) {
        const i64 g = w / cols, q = w % cols;
        double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        for (i64 r = 0; r < rows; ++r) {
            const i64 e0 = first[g] + r * lanes + 8 * q;
            if (e0 >= end[g]) break;
            u32 byte = 0u;
            for (int t = 0; t < 8; ++t) {
                const i64 e = e0 + t;
                if (e >= end[g]) break;
                float a = cp_load(x, dtype, e);
                if (feedback) {
                    a = __fadd_rn(a, error[e]);
                    acc[e] = a;
                }
                s[t] = __dadd_rn(s[t], (double)fabsf(a));
                if (a < 0.0f) byte |= 1u << t;
            }
            packed[byte_first[g] + r * cols + q] = (u8)byte;
        }
        for (int t = 0; t < 8; ++t) sums[g * lanes + 8 * q + t] = s[t];
    }
}

// One thread per byte j of a rank's payload (m bytes: every span's ceil(n/8), end to end). Its span
// t is the last one starting at or before j. out = (sum over ranks, in order, of +-scales[r, t]) /
// world, in float32; with feedback, residual -= this rank's own +-scale.
extern "C" __global__ void cp_sign_decode(const u8* packed, const float* scales, void* out, int dtype, float* residual,
                                          int feedback, int rank, const i64* packed_at, const i64* offsets,
                                          const i64* lengths, i64 spans, i64 m, int world) {
    CP_GRID_STRIDE(j, m) {
        i64 lo = 0, hi = spans - 1;
        while (lo < hi) {
            const i64 mid = (lo + hi + 1) / 2;
            if (packed_at[mid] <= j) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const i64 t = lo, i0 = (j - packed_at[t]) * 8;
        for (int b = 0; b < 8; ++b) {
            const i64 i = i0 + b;
            if (i >= lengths[t]) break;
            const i64 e = offsets[t] + i;
            float sum = 0.0f, own = 0.0f;
            for (int r = 0; r < world; ++r) {
                const float s = scales[(i64)r * spans + t];
                const float v = ((packed[(i64)r * m + j] >> b) & 1u) ? -s : s;
                sum = r == 0 ? v : __fadd_rn(sum, v);
                if (r == rank) own = v;
            }
            if (world > 1) sum = __fdiv_rn(sum, (float)world);
            cp_store(out, dtype, e, sum);
            if (feedback) residual[e] = __fsub_rn(residual[e], own);
        }
    }
}
