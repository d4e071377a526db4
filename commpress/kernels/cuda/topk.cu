// Top-k support: compact the chosen entries (values + int32 indices) and zero them in the
// error buffer in the same pass; scatter-add decode of all ranks' sparse payloads.
#include "common.cuh"

// values[j] = acc[idx[j]] (bit copy in acc's dtype), acc[idx[j]] = 0, idx32[j] = idx[j].
extern "C" __global__ void cp_gather_and_zero(void* acc, int dtype, const i64* idx, i64 k, void* values, int* idx32) {
    CP_GRID_STRIDE(j, k) {
        i64 i = idx[j];
        if (dtype == CP_F32) {
            ((float*)values)[j] = ((float*)acc)[i];
            ((float*)acc)[i] = 0.0f;
        } else {
            ((u16*)values)[j] = ((u16*)acc)[i];
            ((u16*)acc)[i] = 0;
        }
        idx32[j] = (int)i;
    }
}

// acc[idx[j]] += values[j] for one rank; launched once per rank, in rank order, on one stream.
// Indices within a rank are distinct, so every element sees its additions in rank order. An
// index outside [0, n) is skipped (the host does not read the range: that would wait for the device).
extern "C" __global__ void cp_scatter_add_rank(const void* values, int dtype, const int* idx, i64 k, i64 n, float* acc) {
    CP_GRID_STRIDE(j, k) {
        int i = idx[j];
        if (i >= 0 && i < n) atomicAdd(acc + i, cp_load(values, dtype, j));
    }
}

// acc[i] /= divisor for every index i of the ranks' payloads (idx: world * k entries), once per
// index: the first entry to set i's bit in `seen` (zeroed, one bit per element) divides. A float32
// output is summed in place and only the entries that received values need the division; the
// others stay +0, as 0 / divisor is.
extern "C" __global__ void cp_divide_touched(const int* idx, i64 count, i64 n, u32* seen, float* acc, int divisor) {
    CP_GRID_STRIDE(j, count) {
        const int i = idx[j];
        if (i < 0 || i >= n) continue;
        const u32 bit = 1u << (i & 31);
        if (!(atomicOr(seen + (i >> 5), bit) & bit)) acc[i] = __fdiv_rn(acc[i], (float)divisor);
    }
}

// out[i] = acc[i] / divisor (divisor > 1) or acc[i], rounded to out's dtype.
extern "C" __global__ void cp_finish(const float* acc, void* out, int dtype, i64 n, int divisor) {
    CP_GRID_STRIDE(i, n) {
        float v = acc[i];
        if (divisor > 1) v = __fdiv_rn(v, (float)divisor);
        cp_store(out, dtype, i, v);
    }
}
