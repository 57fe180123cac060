// The FP8 quantisation rule of design §6 in plain integer and IEEE fp32 arithmetic, used by both backends: the CPU
// backend and the CUDA kernels compile these same functions, so they agree bit for bit. The e4m3 rounding is done
// here on the bits; the kernels convert with the GPU's instruction instead (e4m3x4_from_floats, proven equal to
// float_to_e4m3 on every fp32 value by test_gpu_fp8). The fp32 operations are IEEE, round to nearest even, on both
// sides: per block one division for the scale and one for its inverse (__fdiv_rn on the device, whatever the compile
// flags; plain `/` on the host, which assumes denormals are not flushed: the default of C++ and of torch), per value
// one multiplication by the inverse (a division by the scale only in blocks whose inverse is not a finite fp32).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/bf16.hpp"
#include "common/macros.hpp"
#include "flatep/fp8.hpp"

namespace flatep::fp8 {

inline constexpr uint8_t kE4m3Nan = 0x7f;               // what a NaN input quantises to (whatever its sign)
inline constexpr uint8_t kE4m3MaxBits = 0x7e;           // 448
inline constexpr uint32_t kFloatMaxBits = 0x43e00000u;  // 448.0f: |v| at or above it saturates
inline constexpr uint32_t kBf16FiniteLimit = 0x7f80u;   // bf16 magnitudes at or above it are Inf or NaN

using flatep::float_bits;  // common/bf16.hpp
using flatep::float_from_bits;

FLATEP_HD int count_leading_zeros(uint32_t word) {  // word != 0
#if defined(__CUDA_ARCH__)
    return __clz(word);
#else
    return __builtin_clz(word);
#endif
}

// The amax contribution of one bf16 value: its magnitude bits when finite, 0 for NaN and +-Inf (ignored). Magnitude
// bits of finite bf16 values order like the values, so amax is an integer max: exact and order-free.
FLATEP_HD uint32_t bf16_amax_bits(uint16_t bits) {
    const uint32_t magnitude = bits & 0x7fffu;
    return magnitude < kBf16FiniteLimit ? magnitude : 0u;
}

// The scale of a block whose amax (bf16 magnitude bits, from bf16_amax_bits) is given.
//   amax == 0 (zeros, NaN and Inf only): 1.
//   kFloat: amax / 448 in fp32, round to nearest even (a subnormal fp32 for amax < 448 * 2^-126).
//   kUe8m0: 2^e for the smallest integer e with 448 * 2^e >= amax, computed exactly from amax's bits (e in
//   [-141, 120] for bf16 amax; below -126 the power of two is an fp32 subnormal, still exact).
FLATEP_HD float block_scale(uint32_t amax_bits, Fp8Scale mode) {
    if (amax_bits == 0) return 1.0f;
    const uint32_t word = amax_bits << 16;  // amax as fp32 bits
    if (mode == Fp8Scale::kFloat) {
        const float amax = float_from_bits(word);
#if defined(__CUDA_ARCH__)
        return __fdiv_rn(amax, kFp8Max);
#else
        return amax / kFp8Max;
#endif
    }
    // amax = 1.f * 2^exponent with f the 23 fraction bits (normalising a subnormal amax first).
    int exponent = int(word >> 23) - 127;
    uint32_t fraction = word & 0x7fffffu;
    if ((word >> 23) == 0) {
        const int shift = count_leading_zeros(fraction) - 8;  // brings the leading one to bit 23
        fraction = (fraction << shift) & 0x7fffffu;
        exponent = -126 - shift;
    }
    // 448 = 1.75 * 2^8: amax <= 448 * 2^(exponent-8) exactly when f <= 0.75, else one power of two more.
    const int e = exponent - 8 + (fraction > 0x600000u ? 1 : 0);
    return e >= -126 ? float_from_bits(uint32_t(e + 127) << 23) : float_from_bits(1u << (e + 149));
}

// The multiplier of a block's values: 448 / amax (kFloat; one IEEE division), 1 / scale (kUe8m0: exact where it is
// a normal fp32), 1 when amax is 0. Not finite for amax below about 448 / FLT_MAX (quantize_value then divides).
FLATEP_HD float block_inverse(uint32_t amax_bits, float scale, Fp8Scale mode) {
    if (amax_bits == 0) return 1.0f;
    const float numerator = mode == Fp8Scale::kFloat ? kFp8Max : 1.0f;
    const float denominator = mode == Fp8Scale::kFloat ? float_from_bits(amax_bits << 16) : scale;
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(numerator, denominator);
#else
    return numerator / denominator;
#endif
}

// fp32 -> e4m3 (fn): round to nearest, ties to even, on the bits; saturating: |v| >= 448 (Inf included) gives +-448;
// NaN gives 0x7f; the sign is kept otherwise (-0 and negative values that round to zero give 0x80).
FLATEP_HD uint8_t float_to_e4m3(float value) {
    const uint32_t word = float_bits(value);
    const uint32_t sign = (word >> 24) & 0x80u;
    const uint32_t magnitude = word & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return kE4m3Nan;
    if (magnitude >= kFloatMaxBits) return uint8_t(sign | kE4m3MaxBits);
    const uint32_t exponent = magnitude >> 23, fraction = magnitude & 0x7fffffu;
    uint32_t q, rest, half;
    if (exponent >= 121u) {  // >= 2^-6: an e4m3 normal (biased exponent exponent - 120), 3 fraction bits kept
        q = ((exponent - 120u) << 3) | (fraction >> 20);
        rest = fraction & 0xfffffu;
        half = 0x80000u;
    } else {  // below 2^-6: an e4m3 subnormal, q = round(|v| * 2^9) in [0, 8] (8 is the smallest normal, 0x08)
        const uint32_t significand = exponent == 0 ? fraction : (fraction | 0x800000u);
        uint32_t shift = exponent == 0 ? 140u : 141u - exponent;  // |v| * 2^9 = significand * 2^-shift, shift >= 21
        if (shift > 25u) shift = 25u;                             // significand < 2^24: rounds to 0 either way
        q = significand >> shift;
        rest = significand & ((1u << shift) - 1u);
        half = 1u << (shift - 1u);
    }
    if (rest > half || (rest == half && (q & 1u) != 0)) ++q;  // a carry moves into the exponent, as it should
    return uint8_t(sign | q);
}

// e4m3 (fn) -> fp32, exact; 0x7f and 0xff give a quiet NaN.
FLATEP_HD float e4m3_to_float(uint8_t q) {
    const uint32_t sign = uint32_t(q & 0x80u) << 24;
    const uint32_t exponent = (q >> 3) & 0xfu, mantissa = q & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return float_from_bits(0x7fc00000u);
    if (exponent != 0) return float_from_bits(sign | ((exponent + 120u) << 23) | (mantissa << 20));
    if (mantissa == 0) return float_from_bits(sign);
    const int top = 31 - count_leading_zeros(mantissa);  // value = mantissa * 2^-9 = 1.x * 2^(top - 9)
    return float_from_bits(sign | (uint32_t(top - 9 + 127) << 23) | ((mantissa << (23 - top)) & 0x7fffffu));
}

// One bf16 value of a block with this scale and inverse (block_inverse): e4m3(x * inverse), the product in fp32
// (IEEE, round to nearest even); e4m3(x / scale) where the inverse is not finite (amax below about 1.3e-36).
FLATEP_HD uint8_t quantize_value(uint16_t x, float scale, float inverse) {
    const float v = bf16_to_float(x);
    const bool finite = (float_bits(inverse) & 0x7f800000u) != 0x7f800000u;
#if defined(__CUDA_ARCH__)
    return float_to_e4m3(finite ? __fmul_rn(v, inverse) : __fdiv_rn(v, scale));
#else
    return float_to_e4m3(finite ? v * inverse : v / scale);
#endif
}

#if defined(__CUDACC__)
// The device's form of float_to_e4m3 for four values (v0 in the lowest byte): the GPU's own conversion
// (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, e4m3 subnormals kept, magnitudes of 448 and above and the
// infinities saturated to +-448), then every NaN byte (0x7f or 0xff) made 0x7f, the rule's one NaN. That is
// float_to_e4m3 bit for bit (test_gpu_fp8 puts every fp32 value through both); it takes a few instructions per
// value where the integer form takes a few dozen, which kept the quantising dispatch compute-bound.
FLATEP_DEVICE uint32_t e4m3x4_from_floats(float v0, float v1, float v2, float v3) {
    uint16_t lo = 0, hi = 0;  // cvt d, a, b puts a's byte in the upper half of d
#if defined(__CUDA_ARCH__)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
#endif
    const uint32_t word = uint32_t(lo) | uint32_t(hi) << 16;
    // A byte's low seven bits are all ones only for NaN (saturation stops at 0x7e): +1 carries into its bit 7 alone.
    const uint32_t nan_signs = ((word & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    return word & ~nan_signs;
}

// quantize_value of the four bf16 values in two words (lo's low half first), in the device's form: four e4m3 bytes.
FLATEP_DEVICE uint32_t quantize_words(uint32_t lo, uint32_t hi, float scale, float inverse) {
    float v0 = float_from_bits(lo << 16), v1 = float_from_bits(lo & 0xffff0000u);
    float v2 = float_from_bits(hi << 16), v3 = float_from_bits(hi & 0xffff0000u);
    if ((float_bits(inverse) & 0x7f800000u) != 0x7f800000u) {
        v0 = __fmul_rn(v0, inverse), v1 = __fmul_rn(v1, inverse), v2 = __fmul_rn(v2, inverse);
        v3 = __fmul_rn(v3, inverse);
    } else {
        v0 = __fdiv_rn(v0, scale), v1 = __fdiv_rn(v1, scale), v2 = __fdiv_rn(v2, scale), v3 = __fdiv_rn(v3, scale);
    }
    return e4m3x4_from_floats(v0, v1, v2, v3);
}

// The amax bits (bf16_amax_bits) of the two bf16 values of a word, as one max: two 16-bit lanes at a time.
FLATEP_DEVICE uint32_t word_amax_bits(uint32_t word) {
    const uint32_t magnitudes = word & 0x7fff7fffu;
    const uint32_t finite = __vcmpltu2(magnitudes, 0x7f807f80u);  // 0xffff in each lane below the Inf bits
    const uint32_t both = magnitudes & finite;
    return max(both & 0xffffu, both >> 16);
}
#endif

// One row of H = num_blocks * 128 bf16 values -> H e4m3 bytes and num_blocks scales (host and device, one thread).
FLATEP_HD void quantize_row(const uint16_t* x, int num_blocks, Fp8Scale mode, uint8_t* q, float* scales) {
    for (int b = 0; b < num_blocks; ++b) {
        const uint16_t* block = x + int64_t(b) * kFp8BlockSize;
        uint32_t amax = 0;
        for (int i = 0; i < kFp8BlockSize; ++i) {
            const uint32_t m = bf16_amax_bits(block[i]);
            amax = m > amax ? m : amax;
        }
        const float scale = block_scale(amax, mode), inverse = block_inverse(amax, scale, mode);
        scales[b] = scale;
        for (int i = 0; i < kFp8BlockSize; ++i)
            q[int64_t(b) * kFp8BlockSize + i] = quantize_value(block[i], scale, inverse);
    }
}

}  // namespace flatep::fp8
