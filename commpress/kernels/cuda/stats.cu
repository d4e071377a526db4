// Per-tensor statistics of a bucket: the largest magnitude and the float64 sum of squares in the
// fixed order of commpress/kernels/stats.py (chunks of rows x lanes), which this mirrors in three
// passes. A chunk list covers the tensors: chunk g holds elements [first[g], end[g]) of the buffer.
// The lane and total passes also finish the 1-bit codes' sums of magnitudes (sign.cu), which
// pass null peaks: sums only.
#include "common.cuh"

// One thread per (chunk, lane): lane j of chunk g sums element j of the chunk's rows, in row order.
extern "C" __global__ void cp_stats_chunks(const void* x, int dtype, const i64* first, const i64* end, i64 chunks,
                                           i64 lanes, i64 rows, double* sums, u32* peaks) {
    CP_GRID_STRIDE(w, chunks * lanes) {
        const i64 g = w / lanes, j = w % lanes;
        double s = 0.0;
        u32 top = 0u;
        for (i64 r = 0; r < rows; ++r) {
            const i64 e = first[g] + r * lanes + j;
            if (e >= end[g]) break;
            const float v = cp_load(x, dtype, e);
            const double d = (double)v;
            s = __dadd_rn(s, __dmul_rn(d, d));
            const u32 b = __float_as_uint(v) & 0x7FFFFFFFu;  // a NaN's bits exceed +inf's: it wins
            top = b > top ? b : top;
        }
        sums[w] = s;
        peaks[w] = top;
    }
}

// One thread per (tensor, lane): lane j of tensor t sums lane j of its chunks in chunk order, into
// its first chunk's slot (the thread is the only one that touches lane j of these chunks).
extern "C" __global__ void cp_stats_lanes(const i64* span_chunks, i64 spans, i64 lanes, double* sums, u32* peaks) {
    CP_GRID_STRIDE(w, spans * lanes) {
        const i64 t = w / lanes, j = w % lanes;
        if (span_chunks[t] == span_chunks[t + 1]) continue;
        double s = 0.0;
        u32 top = 0u;
        for (i64 g = span_chunks[t]; g < span_chunks[t + 1]; ++g) {
            s = __dadd_rn(s, sums[g * lanes + j]);
            if (peaks) top = peaks[g * lanes + j] > top ? peaks[g * lanes + j] : top;
        }
        sums[span_chunks[t] * lanes + j] = s;
        if (peaks) peaks[span_chunks[t] * lanes + j] = top;
    }
}

// One thread per tensor: the lanes in lane order.
extern "C" __global__ void cp_stats_total(const i64* span_chunks, i64 spans, i64 lanes, const double* sums, const u32* peaks,
                                          double* sumsq, float* peak) {
    CP_GRID_STRIDE(t, spans) {
        double s = 0.0;
        u32 top = 0u;
        if (span_chunks[t] < span_chunks[t + 1]) {
            const i64 base = span_chunks[t] * lanes;
            for (i64 j = 0; j < lanes; ++j) {
                s = __dadd_rn(s, sums[base + j]);
                if (peaks) top = peaks[base + j] > top ? peaks[base + j] : top;
            }
        }
        sumsq[t] = s;
        if (peak) peak[t] = __uint_as_float(top);
    }
}
