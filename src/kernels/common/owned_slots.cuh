// The replica slots of one rank's experts, listed once per block: what prefetch (the owner pushes its experts into
// them; serving's pull lists the rank's own filled slots) and reduce_grad (the owner adds their gradients into its
// own) walk instead of scanning the slot table.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "layout/layout.hpp"

namespace flatep::kernels {

// Shared memory of list_owned_slots for a block of kThreads threads and a list of kCapacity slots.
template <int kThreads, int kCapacity>
struct OwnedSlots {
    int32_t listed[kCapacity];  // slot indices d * epn + j, ascending
    int warp_count[kThreads / 32];
    int count;  // slots found; above kCapacity only listed[0, kCapacity) is written
};

// The indices i in [0, n) where listed_if(i) holds, in ascending i, compacted by the whole block (thread `tid` of
// kThreads: a ballot per warp, then the warps' counts in order) into s.listed. Returns the count (every thread); a
// count above kCapacity means the list is incomplete and the caller must walk the table. Begins and ends with a block
// barrier.
template <int kThreads, int kCapacity, class Pred>
FLATEP_DEVICE int list_slots(OwnedSlots<kThreads, kCapacity>& s, int n, Pred listed_if, int tid) {
    const int lane = tid % 32, warp = tid / 32;
    __syncthreads();  // a block listing again: every thread has read the last count and list
    if (tid == 0) s.count = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kThreads) {
        const int i = base + tid;
        const bool mine = i < n && listed_if(i);
        const unsigned ballot = __ballot_sync(kFull, mine);
        if (lane == 0) s.warp_count[warp] = __popc(ballot);
        __syncthreads();
        int at = s.count + __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) at += s.warp_count[w];
        if (mine && at < kCapacity) s.listed[at] = i;
        __syncthreads();
        if (tid == 0) {
            for (int w = 0; w < kThreads / 32; ++w) s.count += s.warp_count[w];
        }
        __syncthreads();
    }
    return s.count;
}

// The slots i = d * epn + j of slot_expert [num_slots] whose expert has home rank `rank`, listed by list_slots.
template <int kThreads, int kCapacity>
FLATEP_DEVICE int list_owned_slots(OwnedSlots<kThreads, kCapacity>& s, int rank, int num_slots, int epn,
                                   const int32_t* slot_expert, int tid) {
    return list_slots(
        s, num_slots,
        [&](int i) {
            const int expert = slot_expert[i];
            return expert >= 0 && home_rank(expert, epn) == rank;
        },
        tid);
}

}  // namespace flatep::kernels
