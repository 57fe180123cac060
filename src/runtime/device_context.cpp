// flatep::make_device_current (include/flatep/device.hpp).
#include "common/check.hpp"
#include "flatep/device.hpp"

#if defined(FLATEP_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace flatep {

void make_device_current(int device) {
    const char* op = "make_device_current";
#if defined(FLATEP_WITH_CUDA)
    int count = 0;
    const cudaError_t counted = cudaGetDeviceCount(&count);
    FLATEP_CHECK_RUNTIME(counted == cudaSuccess, op, ": cudaGetDeviceCount failed: ", cudaGetErrorString(counted));
    FLATEP_CHECK(device >= 0 && device < count, op, ": device must be in [0, ", count, "), got ", device);
    const cudaError_t set = cudaSetDevice(device);
    FLATEP_CHECK_RUNTIME(set == cudaSuccess, op, ": cudaSetDevice(", device, ") failed: ", cudaGetErrorString(set));
#else
    FLATEP_THROW(ErrorCategory::kRuntime, op, ": this FlatEP build has no CUDA support (device ", device, ")");
#endif
}

}  // namespace flatep
