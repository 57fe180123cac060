// FP8 token rows (design §6, "FP8 rows"): e4m3 payload bytes plus one fp32 scale per block of 128 channels of a row,
// x ~= e4m3_value(q) * scale. Torch-free; bf16 rows cross the API as uint16_t bit patterns, e4m3 values as uint8_t.
#pragma once

#include <cstdint>

namespace flatep {

// Channels that share one scale. Rows of FP8 ops need H % kFp8BlockSize == 0.
inline constexpr int kFp8BlockSize = 128;
// Largest finite e4m3 value (the e4m3 "fn" encoding: no infinities, 0x7f / 0xff are NaN).
inline constexpr float kFp8Max = 448.0f;

// How a block's scale is chosen from its amax when bf16 rows are quantised (design §6).
enum class Fp8Scale : int32_t {
    kFloat = 0,  // scale = amax / 448 (fp32, round to nearest even)
    kUe8m0 = 1,  // scale = the smallest power of two with 448 * scale >= amax (UE8M0-representable)
};

// The design §6 rule on the host: x [rows][hidden] bf16 -> q [rows][hidden] e4m3, scales [rows][hidden/128] fp32.
// hidden must be a positive multiple of 128 (kInvalidArgument naming it otherwise). Bitwise what dispatch_fp8
// computes from bf16 rows, on either backend.
void quantize_fp8_rows(const uint16_t* x, int64_t rows, int hidden, Fp8Scale mode, uint8_t* q, float* scales);

}  // namespace flatep
