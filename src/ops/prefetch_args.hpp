// Args of prefetch (design §3, §5): every owner pushes the weights of its experts that are replicated this step
// into the slot pools of the ranks hosting the replicas. One call per projection.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
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

}  // namespace flatep
