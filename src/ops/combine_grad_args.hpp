// Args of combine_grad (design §3, §6): the local part of a weighted combine's backward. After the output gradient
// has been dispatched back to the rows (`rows`), every receive row i of this rank in [0, NvS) gets
//   real rows (a group's [start, start + entries), Layout/plan groups of design §5):
//     grad_y[i][h]    = bf16_rne(float(rows[i][h]) * weights[i])          one fp32 multiply, one rounding
//     grad_weights[i] = dot(rows[i], y[i]) in the fixed order below        fp32
//   padding rows and rows past the last group end: grad_y row 0, grad_weights 0; rows, y and weights are not read
//   there (they may hold anything, NaN included).
// Order of the dot (both backends, bitwise): the H elements form n16 = H/8 chunks of 8 (16 bytes); lane l in
// [0, 32) starts from 0.0f and adds the products of chunks l, l+32, l+64, ... in ascending chunk order, inside a
// chunk elements 0..7 in order, each as acc = acc + (a * b) with a separate fp32 multiply and add (never fused);
// then the 32 lane sums combine by an xor butterfly over offsets 16, 8, 4, 2, 1 (s[l] = s[l] + s[l ^ offset], all
// lanes at once); the result is lane 0's sum. bf16 * bf16 products are exact in fp32 except on underflow.
// Finite inputs give bitwise equal outputs on both backends; NaN payloads may differ (as for every fp32 op).
// Local: no barrier, no peer memory.
#pragma once

#include <cstdint>

#include "common/check.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"

namespace flatep {

struct CombineGradArgs {
    Layout layout;
    int rank;
    PlanView plan;
    const uint16_t* rows;  // [NvS][H] bf16: the output gradient dispatched to this rank's rows (combine backward)
    const uint16_t* y;     // [NvS][H] bf16: the forward combine's y; may be null when grad_weights is null
    const float* weights;  // [NvS] fp32: the forward combine's weights; may be null when grad_y is null
    uint16_t* grad_y;      // [NvS][H] bf16 out, or null (not computed)
    float* grad_weights;   // [NvS] fp32 out, or null (not computed)
};

// The pointer checks both backends (and Buffer::combine_grad) make: kInvalidArgument naming the argument.
inline void check_combine_grad_args(const CombineGradArgs& a) {
    FLATEP_CHECK(a.rank >= 0 && a.rank < a.layout.num_ranks, "combine_grad: rank must be in [0, ", a.layout.num_ranks,
                 "), got ", a.rank);
    FLATEP_CHECK(a.rows != nullptr, "combine_grad: rows is null");
    FLATEP_CHECK(a.grad_y != nullptr || a.grad_weights != nullptr,
                 "combine_grad: grad_y and grad_weights are both null (nothing to compute)");
    FLATEP_CHECK(a.grad_y == nullptr || a.weights != nullptr, "combine_grad: weights is null (grad_y needs it)");
    FLATEP_CHECK(a.grad_weights == nullptr || a.y != nullptr, "combine_grad: y is null (grad_weights needs it)");
    check_aligned16("combine_grad", "rows", a.rows);
    check_aligned16("combine_grad", "y", a.y);
    check_aligned16("combine_grad", "grad_y", a.grad_y);
}

namespace host {

// The CPU twin (src/host/combine_grad.cpp). The dot emulates the kernel's 32 lanes: lane l = c % 32 accumulates
// chunk c, then the xor butterfly. src/host is compiled with -ffp-contract=off, so acc + a * b stays a separate
// multiply and add.
// Local (not collective). Writes every row of grad_y / grad_weights (those not null) for i in [0, NvS).
void run(const CombineGradArgs& args);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/combine_grad): same contract and outputs as host::run (bitwise for finite
// inputs). Local (no barrier). One kernel: a warp per receive row; real rows read rows (and y / weights) once with
// 16-byte loads and write grad_y and the warp-reduced dot; other rows are written zero without reading any input.
void launch(const CombineGradArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
