// Args of write_grads (ExpertPools, design §5): one projection's weight gradients as a grouped GEMM computes them,
// [2*epn][expert_elems] in bf16 or fp32 (group g < epn: own expert g; group epn + j: slot j), into the layer's fp32
// grads view [2*epn][expert_elems] (own grads, then this rank's reduce pool), in the state reduce_grad expects:
//   own group g:  grads[g] = float(grad[g]) (exact) when the group has rows this step (cu_seqlens), else zero;
//                 accumulate: grads[g] = grads[g] + float(grad[g]) (one fp32 add per element) when the group has
//                 rows, else not touched (gradient accumulation over micro-batches, Megatron's main_grad);
//   slot j:       grads[epn + j] = float(grad[epn + j]) when the slot is used (slot_expert[j] >= 0) and has rows;
//                 otherwise not touched: it keeps what the last reduce_grad left, zero (consumed slots are zeroed
//                 there, unused slots are never written), so reduce_grad adds nothing for a used slot without rows.
// A conversion: both backends bitwise equal. Local: no barrier, no peer memory.
#pragma once

#include <cstdint>

#include "common/check.hpp"
#include "common/macros.hpp"
#include "ops/forward.hpp"

namespace flatep {

struct WriteGradsArgs {
    int experts_per_rank;
    int64_t expert_elems;        // elements of one expert's gradient of this projection (rows * cols)
    const int32_t* slot_expert;  // [epn] this rank's slots (plan), -1 = unused
    const int32_t* cu_seqlens;   // [2*epn] this rank's inclusive padded group ends (plan)
    const void* grad;            // [2*epn][expert_elems] bf16 (grad_bytes 2) or fp32 (grad_bytes 4)
    int grad_bytes;
    float* grads;     // [2*epn][expert_elems] fp32 out: the layer's grads view of this projection
    bool accumulate;  // own groups: add into grads instead of overwriting (slot groups are always overwritten)
};

// The checks both backends make: kInvalidArgument naming the argument.
inline void check_write_grads_args(const WriteGradsArgs& a) {
    FLATEP_CHECK(a.experts_per_rank >= 1, "write_grads: experts_per_rank must be positive, got ", a.experts_per_rank);
    FLATEP_CHECK(a.expert_elems >= 1, "write_grads: expert_elems must be positive, got ", a.expert_elems);
    FLATEP_CHECK(a.grad_bytes == 2 || a.grad_bytes == 4, "write_grads: grad_bytes must be 2 (bf16) or 4 (fp32), got ",
                 a.grad_bytes);
    FLATEP_CHECK(a.grad != nullptr, "write_grads: grad is null");
    FLATEP_CHECK(a.grads != nullptr, "write_grads: grads is null");
    FLATEP_CHECK(a.slot_expert != nullptr && a.cu_seqlens != nullptr, "write_grads: the plan arrays are null");
}

// What write_grads does with group g (< 2*epn) of this step, from the plan arrays as they are in memory.
enum GroupGradAction : int { kGradSkip = 0, kGradCopy = 1, kGradZero = 2, kGradAdd = 3 };

FLATEP_HD GroupGradAction group_grad_action(int experts_per_rank, const int32_t* slot_expert, const int32_t* cu_seqlens,
                                            int g, bool accumulate) {
    const bool has_rows = cu_seqlens[g] > (g == 0 ? 0 : cu_seqlens[g - 1]);
    if (g < experts_per_rank) {
        if (accumulate) return has_rows ? kGradAdd : kGradSkip;
        return has_rows ? kGradCopy : kGradZero;
    }
    return has_rows && slot_expert[g - experts_per_rank] >= 0 ? kGradCopy : kGradSkip;
}

namespace host {

// The CPU twin (src/host/write_grads.cpp). Local (not collective).
void run(const WriteGradsArgs& args);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/write_grads): same contract and outputs as host::run (bitwise: a
// conversion). Local (no barrier). One kernel: the grid walks the 2*epn groups' elements as one grid-stride index
// space, each thread deciding a group's action from the plan arrays in device memory (no host synchronisation) when
// it enters it and jumping over a skipped group; 8 elements per step (16-byte bf16 loads, 32-byte fp32 stores) when
// the sizes and pointers allow, element by element otherwise.
void launch(const WriteGradsArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
