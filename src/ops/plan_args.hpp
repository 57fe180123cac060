// Args of the plan op (design §3): local histogram, all-gather of counts, planner, routing of this rank's
// entries, and the push of row-chain metadata to the destinations. Shared by the CPU twin and the CUDA launcher.
#pragma once

#include <cstdint>

#include "common/check.hpp"
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
    // The static planner's placement table (planner/static_placement.hpp), set up by Buffer::set_placement: host
    // memory for the CPU twin, device memory for the CUDA plan op. Null for every other planner.
    const int32_t* placement = nullptr;
    uint8_t* peers[kMaxRanks];  // every rank's symmetric buffer base (SymmetricLayout offsets)
    PlanView plan;              // this rank's plan allocation
    sync::SyncArgs sync;
    // CUDA plan op only: device scratch of device::plan_workspace_bytes(layout) bytes (runtime/device_ops.hpp: the
    // kernels' part and the GPU planner's), or null (the kernels library then keeps one, allocated on first use
    // outside stream capture). The host twin ignores it.
    void* workspace = nullptr;
};

// The checks of what a caller passes to plan, made once by the Buffer (before it allocates) and again by both
// backends' plan op: kInvalidArgument naming the argument and the offending value. Expert ids are checked per entry
// by the op itself (device status word, design §8).
inline void check_plan_inputs(const Layout& l, int num_tokens, const void* topk_idx, int index_bytes) {
    FLATEP_CHECK(num_tokens >= 0 && num_tokens <= l.num_tokens, "plan: num_tokens must be in [0, S=", l.num_tokens,
                 "], got ", num_tokens);
    FLATEP_CHECK(index_bytes == 4 || index_bytes == 8, "plan: index_bytes must be 4 (int32) or 8 (int64), got ",
                 index_bytes);
    FLATEP_CHECK(num_tokens == 0 || topk_idx != nullptr, "plan: topk_idx is null");
}

// The checks both backends' plan op make: the inputs above, the planner kind (and the static planner's placement)
// and the rank.
inline void check_plan_args(const PlanArgs& a) {
    check_plan_inputs(a.layout, a.num_tokens, a.topk_idx, a.index_bytes);
    check_planner_kind(a.planner, "plan: ");
    FLATEP_CHECK(a.planner != PlannerKind::kStatic || a.placement != nullptr,
                 "plan: the static planner has no placement yet: call set_placement (collective) first");
    FLATEP_CHECK(a.rank >= 0 && a.rank < a.layout.num_ranks, "plan: rank must be in [0, ", a.layout.num_ranks,
                 "), got ", a.rank);
}

}  // namespace flatep
