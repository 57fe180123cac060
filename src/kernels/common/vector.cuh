// 16-byte vector loads/stores, bf16x8 pack/unpack and warp-wide row copies shared by the data-plane kernels.
#pragma once

#include <cstdint>

#include "common/bf16.hpp"
#include "common/macros.hpp"

namespace flatep::kernels {

// The 8 bf16 of a 16-byte word as floats (exact), element order: the low half of each 32-bit word first.
FLATEP_DEVICE void unpack_bf16x8(float (&out)[8], const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = bf16_to_float(uint16_t(w[i] & 0xffffu));
        out[2 * i + 1] = bf16_to_float(uint16_t(w[i] >> 16));
    }
}

// 8 floats as 8 bf16 (round to nearest even) in one 16-byte word, the layout unpack_bf16x8 reads.
FLATEP_DEVICE uint4 pack_bf16x8(const float (&in)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = uint32_t(float_to_bf16(in[2 * i])) | (uint32_t(float_to_bf16(in[2 * i + 1])) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Plain global 16-byte load/store. Peer rows are read only after a barrier (acquire) that follows the writer's
// release, so ordinary (weak) accesses suffice; no .nc: the data may have been written during this step.
FLATEP_DEVICE uint4 ld_v4(const uint4* ptr) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

FLATEP_DEVICE void st_v4(uint4* ptr, const uint4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// How many warps share one row when a call has fewer rows than the grid has warps (a decode-sized call): the row's
// steps (32*kUnroll words each) are dealt round-robin to num_slices warps, slice j taking steps j, j + num_slices,
// ...; with as many rows as warps or more, 1 (a warp per row). Every element is still read and summed by one lane in
// the same order, so the result does not depend on the split.
FLATEP_DEVICE int row_slices(int64_t num_rows, int64_t num_warps, int64_t num_steps) {
    const int64_t per_row = num_rows > 0 ? num_warps / num_rows : 1;
    return int(per_row < 1 ? 1 : (per_row > num_steps ? num_steps : per_row));
}

// One step of a warp's walk along a row of n16 16-byte words: lane `lane` loads the words i0 + 32*u + lane
// (u < kUnroll) that lie below n16 into v[u]; the others are left as they were.
template <int kUnroll>
FLATEP_DEVICE void warp_load_step(uint4 (&v)[kUnroll], const uint4* src, int64_t i0, int64_t n16, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + 32 * u + lane;
        if (i < n16) v[u] = ld_v4(src + i);
    }
}

// The store of the same step: v[u] to the words i0 + 32*u + lane below n16.
template <int kUnroll>
FLATEP_DEVICE void warp_store_step(uint4* dst, const uint4 (&v)[kUnroll], int64_t i0, int64_t n16, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + 32 * u + lane;
        if (i < n16) st_v4(dst + i, v[u]);
    }
}

// The same store of fp32 sums: acc[u] rounded to 8 bf16 (pack_bf16x8), for the words below n16 only.
template <int kUnroll>
FLATEP_DEVICE void warp_store_bf16x8_step(uint4* dst, const float (&acc)[kUnroll][8], int64_t i0, int64_t n16,
                                          int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = i0 + 32 * u + lane;
        if (i < n16) st_v4(dst + i, pack_bf16x8(acc[u]));
    }
}

// Copies n16 16-byte words from src to dst, one warp, kUnroll loads in flight per lane.
template <int kUnroll = 4>
FLATEP_DEVICE void warp_copy_v4(uint4* dst, const uint4* src, int64_t n16, int lane) {
    int64_t i = lane;
    for (; i + 32 * (kUnroll - 1) < n16; i += 32 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = ld_v4(src + i + 32 * u);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) st_v4(dst + i + 32 * u, v[u]);
    }
    for (; i < n16; i += 32) st_v4(dst + i, ld_v4(src + i));
}

FLATEP_DEVICE void warp_zero_v4(uint4* dst, int64_t n16, int lane) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int64_t i = lane; i < n16; i += 32) st_v4(dst + i, z);
}

}  // namespace flatep::kernels
