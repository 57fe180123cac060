// The expert FFN's elementwise steps between and after its two grouped GEMMs (flatep::activate_rows and
// flatep::zero_rows_from_end, include/flatep/ffn.hpp; the runtime's src/runtime/ffn_rows.cpp checks the arguments
// and calls these). Both read the last group end from device memory and bound their work by it: a grouped GEMM over
// receive rows sized for the worst case (the owner planner's R*S*K) computes only the real rows, and the rows past
// the end get zero stores and nothing else. One kernel each, no host synchronisation: graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flatep/ffn.hpp"

namespace flatep::kernels {

// a [rows][ffn] = the activation of h [rows][2*ffn] (swiglu) or [rows][ffn] (silu) on rows r < clamp(*end, 0, rows);
// the others zero (zero_past_end; h not read there) or untouched: flatep::activate_rows' contract. The 16-byte kernel
// when ffn % 8 == 0 and h and a are 16-byte aligned, else the element kernel. rows >= 0 (0: no launch), ffn >= 1, end
// non-null (checked by the caller). num_sms: the SM budget, resolved (0: no cap).
void launch_activate_rows(const uint16_t* h, uint16_t* a, int64_t rows, int64_t ffn, FfnActivation activation,
                          const int32_t* end, bool zero_past_end, cudaStream_t stream, int num_sms);

// y [rows][cols]: rows [clamp(*end, 0, rows), rows) set to zero, the others untouched: flatep::zero_rows_from_end's
// contract. 16-byte stores when cols % 8 == 0 and y is 16-byte aligned. Arguments as launch_activate_rows.
void launch_zero_rows_from_end(uint16_t* y, int64_t rows, int64_t cols, const int32_t* end, cudaStream_t stream,
                               int num_sms);

}  // namespace flatep::kernels
