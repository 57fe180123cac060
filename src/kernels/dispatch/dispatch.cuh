// CUDA dispatch (design §3, §5): same contract and outputs as host::dispatch (bitwise).
#pragma once

#include <cuda_runtime.h>

#include "ops/dispatch_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier -> push (one 16-byte-vectorised store stream per (token, destination rank),
// one weight per entry) -> barrier -> fan-out on the destination (duplicates copied from their chain head, the
// copy-out when recv_x is not the symmetric region, weights, zeroed padding).
void launch(const DispatchArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
