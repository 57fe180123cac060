// Timing statistics shared by the benchmark drivers: the median (the upper one of an even count, as every figure
// of docs/performance.md is) and the minimum of a series, and host wall time of a callable.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace flatep::bench {

// The element at index n/2 of the sorted series (0 for an empty one).
template <typename T>
T median(std::vector<T> v) {
    if (v.empty()) return T(0);
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
    return v[v.size() / 2];
}

struct Timing {
    double median_us = 0, min_us = 0;
};

template <typename T>
Timing summarize(const std::vector<T>& us) {
    if (us.empty()) return Timing{};
    return Timing{double(median(us)), double(*std::min_element(us.begin(), us.end()))};
}

// Host wall time (steady_clock) of fn: `warmup` untimed calls, then `iters` timed ones.
inline Timing time_host(int iters, int warmup, const std::function<void()>& fn) {
    std::vector<double> us;
    for (int it = 0; it < warmup + iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        const auto t1 = std::chrono::steady_clock::now();
        if (it >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    return summarize(us);
}

}  // namespace flatep::bench
