// CUDA write_grads (ExpertPools): same contract and outputs as host::write_grads (bitwise: a conversion). The
// contract is in write_grads_args.hpp.
#pragma once

#include <cuda_runtime.h>

#include "ops/write_grads_args.hpp"

namespace flatep::kernels {

// Local (no barrier). One kernel: the grid walks the 2*epn groups' elements as one grid-stride index space, each
// thread deciding a group's action from the plan arrays in device memory (no host synchronisation) when it enters it
// and jumping over a skipped group; 8 elements per step (16-byte bf16 loads, 32-byte fp32 stores) when the sizes and
// pointers allow, element by element otherwise.
void launch(const WriteGradsArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
