// bfloat16 <-> float conversions used by both backends (bitwise identical on host and device).
// Storage is the raw uint16_t bit pattern: rows cross the API as bf16 without depending on any bf16 type.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/macros.hpp"

namespace flatep {

// The bit pattern of an fp32 value and back (host and device).
FLATEP_HD uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(value);
#else
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    return word;
#endif
}

FLATEP_HD float float_from_bits(uint32_t word) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(word);
#else
    float value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
#endif
}

FLATEP_HD float bf16_to_float(uint16_t bits) { return float_from_bits(uint32_t(bits) << 16); }

// Round to nearest, ties to even; NaN stays NaN (quiet bit set), infinities stay infinite.
FLATEP_HD uint16_t float_to_bf16(float value) {
    const uint32_t word = float_bits(value);
    if ((word & 0x7f800000u) == 0x7f800000u && (word & 0x007fffffu) != 0) {
        return uint16_t((word >> 16) | 0x0040u);
    }
    const uint32_t rounding = 0x7fffu + ((word >> 16) & 1u);
    return uint16_t((word + rounding) >> 16);
}

}  // namespace flatep
