// The kernel preload registry (FLATEP_PRELOAD_KERNELS, kernels/common/launch.cuh) in a binary that builds device
// Buffers and ExpertPools: every .cu of src/kernels registered its preload function, so preload_all_kernels loads
// every kernel such a program can launch. Needs no GPU: registering is host code that runs before main.
// Run: build-cuda/tests/gpu/preload_registry_main
#include <cstdio>

#include "kernels/common/preload.hpp"
#include "runtime/backend.hpp"

#ifndef FLATEP_KERNEL_FILES
#error "tests/gpu/CMakeLists.txt passes FLATEP_KERNEL_FILES: the number of .cu files of src/kernels"
#endif

int main() {
    // What every program that makes a device Buffer or ExpertPools references: the device backends, whose ops call
    // every op's launcher (runtime/device_backend.cpp) and the plan op's halves (runtime/device_ops.cpp), and so link
    // every kernel file.
    auto* volatile buffer_backend = &flatep::runtime::make_device_buffer_backend;
    auto* volatile pools_backend = &flatep::runtime::make_device_pools_backend;
    (void)buffer_backend;
    (void)pools_backend;
    const int registered = flatep::kernels::registered_preloads();
    if (registered != FLATEP_KERNEL_FILES) {
        std::fprintf(stderr,
                     "FAIL: %d kernel files registered a preload function, src/kernels has %d .cu files: a .cu lacks "
                     "its FLATEP_PRELOAD_KERNELS line (or is not linked into the runtime). Reproduce: "
                     "build-cuda/tests/gpu/preload_registry_main\n",
                     registered, FLATEP_KERNEL_FILES);
        return 1;
    }
    std::printf("PASS: %d kernel files registered their preload functions\n", registered);
    return 0;
}
