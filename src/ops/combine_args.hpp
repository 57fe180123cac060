// Args of combine (design §3, §6): each destination sums, per (source, token), its rows in ascending k in fp32
// (optionally weighted, fmaf) and rounds the partial to bf16; each source pulls its partials and adds them in
// ascending destination rank in fp32, rounding to bf16 once.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct CombineArgs {
    Layout layout;
    int rank;
    const uint16_t* y;     // [NvS][H] bf16 expert outputs of this rank's rows
    const float* weights;  // [NvS] fp32 per-row weights for a weighted combine, or null (unweighted)
    PlanView plan;
    uint8_t* peers[kMaxRanks];
    uint16_t* out;  // [s][H] bf16 out, one row per token of this rank
    sync::SyncArgs sync;
};

// combine's contract, checked once per call for both backends. num_tokens: the plan's token count (s; out may be null
// when it is 0: a rank with no tokens still computes the rows other ranks sent it, so y is always needed).
inline void check_combine_args(const CombineArgs& a, int num_tokens) {
    check_op_rank("combine", a.rank, a.layout.num_ranks);
    check_given("combine", "y", a.y);
    check_given("combine", "out", a.out, num_tokens);
    check_aligned16("combine", "y", a.y);
    check_aligned16("combine", "out", a.out);
}

}  // namespace flatep
