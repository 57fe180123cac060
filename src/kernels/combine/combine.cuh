// CUDA combine (design §3, §6): same contract and outputs as host::combine (bitwise).
#pragma once

#include <cuda_runtime.h>

#include "ops/combine_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier -> partials on the destination (per chain head: fp32 sum of the chain's rows in
// ascending k, fmaf when weighted, rounded to bf16 into the symmetric partial region) -> barrier -> pull on the
// source (warp per token: one read per destination rank, fp32 sum in ascending rank, one bf16 rounding).
void launch(const CombineArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
