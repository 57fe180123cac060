// CUDA dispatch of FP8 rows (design §3, §5, §6): same contract and outputs as host::dispatch_fp8 (bitwise).
#pragma once

#include <cuda_runtime.h>

#include "ops/dispatch_fp8_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier -> push (warp per token: the bf16 row is quantised once, in registers, then its
// e4m3 bytes and scales are stored to every destination rank's chain-head row; pre-quantised rows are copied as
// they are; one weight per entry) -> barrier -> fan-out on the destination (duplicates copied from their chain head,
// the copy-out when recv_x / recv_scales are not the symmetric region, weights, zeroed padding rows and scales).
void launch(const DispatchFp8Args& args, cudaStream_t stream, int num_sms);

// Loads the kernels of this file now (see preload_all_kernels in kernels/common/preload.hpp).
void preload_dispatch_fp8_kernels();

}  // namespace flatep::kernels
