// CUDA entry_values: same contract and outputs as host::entry_values (bitwise: copies only).
#pragma once

#include <cuda_runtime.h>

#include "ops/entry_values_args.hpp"

namespace flatep::kernels {

// Collective. Kernels: entry barrier -> publish this rank's real-row values into its symmetric recv_w region ->
// barrier -> every entry of this rank reads the value at its row on its destination rank.
void launch(const EntryValuesArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
