// Args of combine (design §3, §6): each destination sums, per (source, token), its rows in ascending k in fp32
// (optionally weighted, fmaf) and rounds the partial to bf16; each source pulls its partials and adds them in
// ascending destination rank in fp32, rounding to bf16 once.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
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
    // The plan's num_tokens s as the caller knows it on the host (Buffer: Plan::num_tokens), 0 when unknown: sizes
    // the token-side grid to the call (token_grid_warps), so a decode-sized call launches a few blocks and the
    // kernels of several ranks sharing a GPU can run side by side. The kernels still read s from the plan.
    int host_num_tokens;
    SyncArgs sync;
};

}  // namespace flatep
