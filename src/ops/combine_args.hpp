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
    sync::SyncArgs sync;
};

}  // namespace flatep
