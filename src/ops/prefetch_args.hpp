// Args of prefetch (design §3, §5): every owner pushes the weights of its experts that are replicated this step
// into the slot pools of the ranks hosting the replicas. One call per projection.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "ops/check.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct PrefetchArgs {
    int rank;
    int num_ranks;
    int experts_per_rank;
    int64_t expert_bytes;            // bytes of one expert's weights for this projection (H*H' bf16)
    const int32_t* slot_expert;      // [R][epn] from the plan
    const uint8_t* weights;          // this rank's own experts [epn][expert_bytes]
    uint8_t* slot_pools[kMaxRanks];  // every rank's slot pool [epn][expert_bytes], as mapped here
    sync::SyncArgs sync;
};

// prefetch's contract, checked once per call for both backends.
inline void check_prefetch_args(const PrefetchArgs& a) {
    FLATEP_CHECK(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "prefetch: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", a.num_ranks);
    check_op_rank("prefetch", a.rank, a.num_ranks);
    FLATEP_CHECK(a.expert_bytes > 0 && a.expert_bytes % 16 == 0,
                 "prefetch: expert_bytes must be a positive multiple of 16, got ", a.expert_bytes);
    check_given("prefetch", "slot_expert", a.slot_expert);
    check_given("prefetch", "weights", a.weights);
    check_aligned16("prefetch", "weights", a.weights);
    for (int r = 0; r < a.num_ranks; ++r) {
        check_given("prefetch", "a slot pool", a.slot_pools[r]);
        check_aligned16("prefetch", "a slot pool", a.slot_pools[r]);
    }
}

}  // namespace flatep
