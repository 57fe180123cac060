// The CUDA driver API loaded at run time (dlopen("libcuda.so.1")), so that binaries of a CUDA build still start on
// machines without a driver: the ipc transport then refuses device memory with a clear error, and GPU tests skip.
#pragma once

#include <cuda.h>

#include <string>

// Every driver function FlatEP's host code calls. Names go through cuda.h's macros, so cuMemsetD8 is the
// versioned cuMemsetD8_v2 entry point (the same one a link against libcuda would bind).
// clang-format off (clang-format 14 re-flows this X-macro differently on every pass)
#define FLATEP_CU_DRIVER_FUNCTIONS(X) \
    X(cuGetErrorName)                 \
    X(cuInit)                         \
    X(cuDeviceGet)                    \
    X(cuDeviceGetCount)               \
    X(cuDeviceGetName)                \
    X(cuDeviceGetAttribute)           \
    X(cuDevicePrimaryCtxRetain)       \
    X(cuDevicePrimaryCtxRelease)      \
    X(cuCtxGetCurrent)                \
    X(cuCtxSetCurrent)                \
    X(cuCtxGetDevice)                 \
    X(cuCtxSynchronize)               \
    X(cuMemGetAllocationGranularity)  \
    X(cuMemCreate)                    \
    X(cuMemRelease)                   \
    X(cuMemAddressReserve)            \
    X(cuMemAddressFree)               \
    X(cuMemMap)                       \
    X(cuMemUnmap)                     \
    X(cuMemSetAccess)                 \
    X(cuMemExportToShareableHandle)   \
    X(cuMemImportFromShareableHandle) \
    X(cuMemsetD8)                     \
    X(cuMemsetD32)                    \
    X(cuMemcpyHtoD)                   \
    X(cuMemcpyDtoH)                   \
    X(cuMemGetInfo)
// clang-format on

namespace flatep::transport {

struct CuDriver {
#define FLATEP_CU_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
    FLATEP_CU_DRIVER_FUNCTIONS(FLATEP_CU_DRIVER_MEMBER)
#undef FLATEP_CU_DRIVER_MEMBER
};

// The loaded driver (loaded once per process), or nullptr when libcuda.so.1 or one of its functions is missing;
// then *why (when given) says which.
const CuDriver* cu_driver(std::string* why = nullptr);

// "cuMemCreate(...) failed: CUDA_ERROR_OUT_OF_MEMORY".
std::string cu_error_text(const CuDriver& driver, CUresult result, const char* what);

}  // namespace flatep::transport

// FLATEP_CU_DRIVER_CHECK(driver, cuMemCreate(&h, bytes, &prop, 0)): calls driver.<expr> and throws
// flatep::Error(kRuntime) naming the call and the CUresult.
#define FLATEP_CU_DRIVER_CHECK(driver, expr)                                              \
    do {                                                                                  \
        const CUresult flatep_res_ = (driver).expr;                                       \
        if (flatep_res_ != CUDA_SUCCESS)                                                  \
            FLATEP_THROW(::flatep::ErrorCategory::kRuntime,                               \
                         ::flatep::transport::cu_error_text(driver, flatep_res_, #expr)); \
    } while (0)
