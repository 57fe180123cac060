// CUDA error checks for host code of the kernels library, tests and benchmarks.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

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
