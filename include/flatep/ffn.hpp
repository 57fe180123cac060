// The expert FFN's elementwise steps on the GPU (design §6, "Expert FFN"), for a grouped GEMM over receive rows whose
// real rows end at a count known only on the device: the activation of the first GEMM's output and the zeroing of the
// second's rows past that end. Both read `end` (the device address of an int32: the last inclusive group end,
// cu_seqlens[G - 1]) on the device, clamp it to [0, rows], and never synchronise with the host: graph-capturable, and
// a captured graph replayed after the int32 changed uses the new value. bf16 values cross as their uint16_t bit
// patterns; every pointer is device memory of the current device. Torch-free (flatep.ffn calls them from Python).
#pragma once

#include <cstdint>

#include "flatep/launch.hpp"

namespace flatep {

// The expert activation (flatep.ffn.ACTIVATIONS).
enum class FfnActivation : int32_t {
    kSwiglu = 0,  // h [rows][2F]: columns [0, F) the gate, [F, 2F) the up projection; a = silu(gate) * up
    kSilu = 1,    // h [rows][F]; a = silu(h)
};

// What activate_rows does with the rows at and past the end.
enum class PastEnd : int32_t {
    kZero = 0,       // written as zero (h not read there)
    kUntouched = 1,  // neither read nor written: for a consumer that reads no row past the end (a grouped GEMM whose
                     // groups end there); no work then follows the capacity, only the real rows
};

// a [rows][ffn] bf16 from h [rows][2*ffn] (swiglu) or [rows][ffn] (silu) bf16, both row-major and contiguous: rows
// below *end get silu(gate) * up (swiglu) or silu(h) (silu) with silu(x) = x / (1 + expf(-x)), all in fp32 (accurate
// expf, IEEE division and product) and rounded once to bf16, round to nearest even: bitwise what flatep.ffn.activate
// (torch's CUDA silu in fp32, a multiply, .to(bfloat16)) gives those rows. Rows at or past *end: as `past_end` says.
// 16-byte accesses when ffn % 8 == 0 and h and a are 16-byte aligned, element accesses otherwise. rows >= 0 (0:
// nothing is launched), ffn >= 1; h and a must not overlap. launch.num_sms: the most thread blocks the launch uses (0:
// no cap; -1: FLATEP_NUM_SMS). Throws kInvalidArgument naming a bad argument, and kRuntime in a build without CUDA.
void activate_rows(const uint16_t* h, uint16_t* a, int64_t rows, int64_t ffn, FfnActivation activation,
                   const int32_t* end, PastEnd past_end, const Launch& launch = {});

// Rows [*end, rows) of y [rows][cols] bf16 (row-major, contiguous) set to zero; rows below *end untouched (never
// read). 16-byte stores when cols % 8 == 0 and y is 16-byte aligned. rows >= 0 (0: nothing is launched), cols >= 1;
// launch and errors as activate_rows.
void zero_rows_from_end(uint16_t* y, int64_t rows, int64_t cols, const int32_t* end, const Launch& launch = {});

}  // namespace flatep
