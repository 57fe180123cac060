// Args of reduce_grad (design §3, §6): owners add the fp32 gradients computed on replicas of their experts
// into their own gradients, in ascending (rank, slot) order, and zero the slots they consumed; a closing barrier keeps
// every holder from writing its slots again before the owners are done.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "ops/check.hpp"
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

// reduce_grad's contract, checked once per call for both backends.
inline void check_grad_reduce_args(const GradReduceArgs& a) {
    FLATEP_CHECK(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "reduce_grad: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", a.num_ranks);
    check_op_rank("reduce_grad", a.rank, a.num_ranks);
    FLATEP_CHECK(a.expert_elems > 0 && a.expert_elems % 4 == 0,
                 "reduce_grad: expert_elems must be a positive multiple of 4, got ", a.expert_elems);
    check_given("reduce_grad", "slot_expert", a.slot_expert);
    check_given("reduce_grad", "grads", a.grads);
    check_aligned16("reduce_grad", "grads", a.grads);
    for (int r = 0; r < a.num_ranks; ++r) {
        check_given("reduce_grad", "a reduce pool", a.reduce_pools[r]);
        check_aligned16("reduce_grad", "a reduce pool", a.reduce_pools[r]);
    }
}

}  // namespace flatep
