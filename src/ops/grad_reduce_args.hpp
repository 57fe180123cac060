// Args of reduce_grad (design §3, §6): owners add the fp32 gradients computed on replicas of their experts
// into their own gradients, in ascending (rank, slot) order, and zero the slots they consumed; a closing barrier keeps
// every holder from writing its slots again before the owners are done.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
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

namespace host {

// The CPU twin (src/host/grad_reduce.cpp). Runs rank args.rank's part; collective.
//   barrier; for each own expert g (id rank*epn + g): grads[g] = grads[g] + pool_d[j] for (d ascending, j ascending)
//   with slot_expert[d][j] == id, one fp32 add at a time, reading the peers' reduce pools; barrier;
//   every rank zeroes its consumed slots (slot_expert[rank][j] >= 0) in its own reduce pool.
void run(const GradReduceArgs& args);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/grad_reduce): same contract and outputs as host::run (bitwise).
// Collective. Kernels: entry barrier (every replica's gradient is complete) -> owners add the slot gradients of
// their experts into their own, per element grad + pool[d0][j0] + pool[d0][j1] + ... in ascending (rank, slot)
// order in fp32 -> barrier (every owner has read the pools) -> each rank zeroes its consumed slots.
void launch(const GradReduceArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
