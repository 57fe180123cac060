// Host, plain C++ (no device code, so the runtime's .cpp files include it): preloading every kernel of the library.
#pragma once

namespace flatep::kernels {

// Loads every kernel of the library on the current device now. CUDA's lazy module loading may otherwise load a
// kernel at its first launch and wait for running kernels while doing so, which deadlocks (until the timeout) when a
// running kernel spins on a peer whose kernel is the one being loaded. The runtime and LocalDeviceGroup
// (src/testing) call it; each op's preload_* (kernels/common/launch.cuh) loads that op's kernels.
void preload_all_kernels();

}  // namespace flatep::kernels
