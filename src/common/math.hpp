// Small integer helpers, usable on host and device.
#pragma once

#include <cstdint>

#include "common/macros.hpp"

namespace flatep {

template <typename T>
FLATEP_HD constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

template <typename T>
FLATEP_HD constexpr T round_up(T a, T b) {
    return ceil_div(a, b) * b;
}

template <typename T>
FLATEP_HD constexpr T min_of(T a, T b) {
    return a < b ? a : b;
}

template <typename T>
FLATEP_HD constexpr T max_of(T a, T b) {
    return a < b ? b : a;
}

// Length of the overlap of the half-open intervals [a0, a1) and [b0, b1); 0 when they are disjoint.
FLATEP_HD constexpr int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
    const int64_t lo = a0 > b0 ? a0 : b0;
    const int64_t hi = a1 < b1 ? a1 : b1;
    return hi > lo ? hi - lo : 0;
}

// Carves consecutive arrays out of one allocation, each starting at a multiple of `align` elements: take(n) returns
// the offset of the next array of n elements; `at` ends as the elements the allocation needs.
struct Carver {
    int64_t align;
    int64_t at = 0;
    FLATEP_HD int64_t take(int64_t n) {
        const int64_t start = at;
        at += round_up(n, align);
        return start;
    }
};

// FNV-1a, used for config hashes and per-job nonces; stable across platforms.
inline constexpr uint64_t kFnvOffset = 1469598103934665603ull;
inline constexpr uint64_t kFnvPrime = 1099511628211ull;
FLATEP_HD constexpr uint64_t fnv1a_mix(uint64_t h, uint64_t value) {
    for (int i = 0; i < 8; ++i) {
        h ^= (value >> (8 * i)) & 0xffu;
        h *= kFnvPrime;
    }
    return h;
}

}  // namespace flatep
