// Args of the plan op (design §3): local histogram, all-gather of counts, planner, routing of this rank's
// entries, and the push of row-chain metadata to the destinations. Shared by the CPU twin and the CUDA launcher.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct PlanArgs {
    Layout layout;
    int rank;
    int num_tokens;        // s <= S tokens passed this call
    const void* topk_idx;  // [s][K] expert ids, int32 or int64 (index_bytes)
    int index_bytes;       // 4 or 8
    PlannerKind planner;
    uint8_t* peers[kMaxRanks];  // every rank's symmetric buffer base (SymmetricLayout offsets)
    PlanView plan;              // this rank's plan allocation
    SyncArgs sync;
    // CUDA launcher only: device scratch of kernels::plan_workspace_bytes(layout) bytes, or null (the launcher then
    // keeps its own, allocated on first use outside stream capture). The host twin ignores it.
    void* workspace = nullptr;
};

}  // namespace flatep
