// CUDA combine_grad: same contract and outputs as host::combine_grad (bitwise for finite inputs; the contract and the
// dot's summation order are in combine_grad_args.hpp).
#pragma once

#include <cuda_runtime.h>

#include "ops/combine_grad_args.hpp"

namespace flatep::kernels {

// Local (no barrier). One kernel: a warp per receive row; real rows read rows (and y / weights) once with 16-byte
// loads and write grad_y and the warp-reduced dot; other rows are written zero without reading any input.
void launch(const CombineGradArgs& args, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
