// Args of reduce_grad (design §3, §6): owners add the fp32 gradients computed on replicas of their experts
// into their own gradients, in ascending (rank, slot) order, and zero the slots they consumed; a closing barrier keeps
// every holder from writing its slots again before the owners are done.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct GradReduceArgs {
    int rank;
    int num_ranks;
    int experts_per_rank;
    int64_t expert_elems;            // fp32 elements of one expert's gradient for this projection
    const int32_t* slot_expert;      // [R][epn] from the plan
    float* grads;                    // this rank's own expert gradients [epn][expert_elems], accumulated into
    float* reduce_pools[kMaxRanks];  // every rank's fp32 reduce pool [epn][expert_elems], as mapped here
    sync::SyncArgs sync;
};

}  // namespace flatep
