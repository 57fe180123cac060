// CUDA reduce_grad (design §3, §6): same contract and outputs as host::grad_reduce (bitwise).
#pragma once

#include <cuda_runtime.h>

#include "ops/grad_reduce_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier (every replica's gradient is complete) -> owners add the slot gradients of
// their experts into their own, per element grad + pool[d0][j0] + pool[d0][j1] + ... in ascending (rank, slot)
// order in fp32 -> barrier (every owner has read the pools) -> each rank zeroes its consumed slots.
void launch(const GradReduceArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
