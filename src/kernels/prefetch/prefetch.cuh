// CUDA prefetch (design §3, §5): same contract and outputs as host::prefetch (a bitwise copy).
#pragma once

#include <cuda_runtime.h>

#include "ops/prefetch_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier (destinations are done with their previous slots) -> owner push of every
// replicated expert of this rank into the slot of each rank hosting it -> exit barrier (every slot is filled).
void launch(const PrefetchArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
