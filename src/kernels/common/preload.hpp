// Host, plain C++ (no device code, so the runtime's .cpp files include it): preloading every kernel of the library.
#pragma once

namespace flatep::kernels {

// Loads every kernel of the library on the current device now. CUDA's lazy module loading may otherwise load a
// kernel at its first launch and wait for running kernels while doing so, which deadlocks (until the timeout) when a
// running kernel spins on a peer whose kernel is the one being loaded. The runtime and LocalDeviceGroup
// (src/testing) call it; it runs the preload function every .cu of src/kernels linked into the binary registered
// (FLATEP_PRELOAD_KERNELS, kernels/common/launch.cuh).
void preload_all_kernels();

// How many preload functions are registered: one per .cu of src/kernels linked into this binary (tests check it).
int registered_preloads();

}  // namespace flatep::kernels
