// The replica slots of one rank's experts, listed once per block: what prefetch (the owner pushes its experts into
// them) and reduce_grad (the owner adds their gradients into its own) walk instead of scanning the slot table.
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

// The slots i = d * epn + j of slot_expert [num_slots] whose expert has home rank `rank`, in ascending i, compacted by
// the whole block (thread `tid` of kThreads: a ballot per warp, then the warps' counts in order) into s.listed. Returns
// the count (every thread); a count above kCapacity means the list is incomplete and the caller must walk the table.
// Begins and ends with a block barrier.
template <int kThreads, int kCapacity>
FLATEP_DEVICE int list_owned_slots(OwnedSlots<kThreads, kCapacity>& s, int rank, int num_slots, int epn,
                                   const int32_t* slot_expert, int tid) {
    const int lane = tid % 32, warp = tid / 32;
    if (tid == 0) s.count = 0;
    __syncthreads();
    for (int base = 0; base < num_slots; base += kThreads) {
        const int i = base + tid;
        const int expert = i < num_slots ? slot_expert[i] : -1;
        const bool mine = expert >= 0 && home_rank(expert, epn) == rank;
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

}  // namespace flatep::kernels
