// The kernel preload registry (FLATEP_PRELOAD_KERNELS, kernels/common/launch.cuh) in a binary that builds device
// Buffers and ExpertPools: every .cu of src/kernels registered its preload function, so preload_all_kernels loads
// every kernel such a program can launch. Needs no GPU: registering is host code that runs before main.
// Run: build-cuda/tests/gpu/preload_registry_main
#include <cstdio>

#include "flatep/ffn.hpp"
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
    // The expert FFN's row kernels (kernels/ffn_rows) are no op of either backend: a program links them when it calls
    // flatep::activate_rows or zero_rows_from_end, as flatep._C does (the Python FFN), and registers them then.
    auto* volatile activate = &flatep::activate_rows;
    auto* volatile zero_rows = &flatep::zero_rows_from_end;
    (void)buffer_backend;
    (void)pools_backend;
    (void)activate;
    (void)zero_rows;
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
