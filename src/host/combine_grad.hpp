// CPU twin of combine_grad (contract and the dot's summation order in ops/combine_grad_args.hpp).
// The dot emulates the kernel's 32 lanes: lane l = c % 32 accumulates chunk c, then the xor butterfly.
// src/host is compiled with -ffp-contract=off, so acc + a * b stays a separate multiply and add.
#pragma once

#include "ops/combine_grad_args.hpp"

namespace flatep::host {

// Local (not collective). Writes every row of grad_y / grad_weights (those not null) for i in [0, NvS).
void combine_grad(const CombineGradArgs& args);

}  // namespace flatep::host
