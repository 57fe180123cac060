// The CUDA half of common/memory.hpp's check: the free bytes of the current device and its name. Drivers that include
// it get common/run_main.hpp too (every driver's main).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "common/memory.hpp"
#include "common/run_main.hpp"
#include "internal/api.hpp"

namespace flatep::bench {

// cudaMemGetInfo's free bytes of the current device (its context created by the call).
inline int64_t device_free_bytes() {
    size_t free_bytes = 0, total_bytes = 0;
    FLATEP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return int64_t(free_bytes);
}

// "cuda:N" of the current device (cuda:0 when there is none to ask: --memory-gib on a machine without a GPU).
inline std::string current_device_name() {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) device = 0;
    return "cuda:" + std::to_string(device);
}

// Checks the estimates against --memory-gib (> 0; no device touched) or the current device's free bytes, before the
// driver allocates anything: prints them, and on a case that does not fit one line and exit 2 (require_fit).
inline void require_device_fit(const std::string& program, const std::vector<MemoryEstimate>& estimates,
                               double memory_gib) {
    const bool given = memory_gib > 0;
    const int64_t free_bytes = available_bytes(memory_gib, given ? 0 : device_free_bytes());
    require_fit(program, estimates, free_bytes, current_device_name(), given);
}

}  // namespace flatep::bench
