// Bit packing: code j of a byte at bits j*b .. j*b+b-1 (b in 1, 2, 4, 8); one thread per byte.
#include "common.cuh"

extern "C" __global__ void cp_pack_bits(const u8* codes, u8* out, i64 n, int bits) {
    const int per = 8 / bits;
    const u32 mask = (1u << bits) - 1u;
    const i64 m = (n * bits + 7) / 8;
    CP_GRID_STRIDE(j, m) {
        u32 byte = 0;
        for (int t = 0; t < per; ++t) {
            i64 e = j * per + t;
            if (e < n) byte |= ((u32)codes[e] & mask) << (t * bits);
        }
        out[j] = (u8)byte;
    }
}

extern "C" __global__ void cp_unpack_bits(const u8* packed, u8* out, i64 n, int bits) {
    const u32 mask = (1u << bits) - 1u;
    CP_GRID_STRIDE(i, n) {
        i64 bit = i * bits;
        out[i] = (u8)((packed[bit >> 3] >> (bit & 7)) & mask);
    }
}
