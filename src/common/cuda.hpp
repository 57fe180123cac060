// Host helpers of every module with CUDA code (kernels, planner, runtime, tests, benchmarks): the CUDA error checks
// and the dynamic shared memory opt-in of a kernel.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "common/check.hpp"

#ifndef FLATEP_CUDA_CHECK
// FLATEP_CUDA_CHECK(cudaMalloc(...)): throws flatep::Error(kRuntime) naming the call and the CUDA error.
#define FLATEP_CUDA_CHECK(expr)                                                                                      \
    do {                                                                                                             \
        const cudaError_t flatep_err_ = (expr);                                                                      \
        if (flatep_err_ != cudaSuccess)                                                                              \
            FLATEP_THROW(::flatep::ErrorCategory::kRuntime, #expr, " failed: ", cudaGetErrorName(flatep_err_), " (", \
                         cudaGetErrorString(flatep_err_), ")");                                                      \
    } while (0)
#endif

#ifndef FLATEP_CU_CHECK
// FLATEP_CU_CHECK(cuMemCreate(...)): the driver-API counterpart.
#define FLATEP_CU_CHECK(expr)                                                                       \
    do {                                                                                            \
        const CUresult flatep_res_ = (expr);                                                        \
        if (flatep_res_ != CUDA_SUCCESS) {                                                          \
            const char* flatep_name_ = nullptr;                                                     \
            cuGetErrorName(flatep_res_, &flatep_name_);                                             \
            FLATEP_THROW(::flatep::ErrorCategory::kRuntime, #expr,                                  \
                         " failed: ", flatep_name_ != nullptr ? flatep_name_ : "unknown CUresult"); \
        }                                                                                           \
    } while (0)
#endif

// After a kernel launch: reports a bad launch configuration at once (not the kernel's own failures).
#define FLATEP_CUDA_CHECK_LAUNCH() FLATEP_CUDA_CHECK(cudaGetLastError())

namespace flatep {

// Raises a kernel's dynamic shared memory limit to at least `bytes` on the current device when its static plus
// dynamic shared memory exceeds the default 48 KiB, once per (kernel, device, size): host calls stay off the
// per-step launch path.
inline void allow_smem(const void* kernel, size_t bytes) {
    static std::mutex mu;
    static std::map<std::pair<const void*, int>, size_t> raised;
    int device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mu);
    size_t& have = raised[{kernel, device}];
    if (have >= bytes) return;
    cudaFuncAttributes attr{};
    FLATEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (attr.sharedSizeBytes + bytes > 48 * 1024) {  // beyond the default limit: opt in
        FLATEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    }
    have = bytes;
}

}  // namespace flatep
