// The source side that the bf16 and the FP8 dispatch kernels share: a warp's view of one token's K entries.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "kernels/common/launch.cuh"
#include "layout/plan.hpp"

namespace flatep::kernels {

// Lanes k < K hold entry k of token t: its destination rank and row (-1 for a skipped entry); `heads` has the bit of
// the first lane of each destination rank (ascending k), whose row the token's row is pushed to.
struct TokenEntries {
    int rank;
    int row;
    unsigned heads;
};

// Reads token t's entries and, when write_weights, stores every entry's routing weight (1 when topk_weights is null)
// at its row of its destination's recv_w. Every lane of the warp must call it (warp votes).
FLATEP_DEVICE TokenEntries token_entries(const PlanView& p, int K, int64_t t, const float* topk_weights,
                                         const PeerPointers& peers, int64_t recv_w_offset, int lane,
                                         bool write_weights = true) {
    int d = -1, row = -1;
    if (lane < K) {
        d = p.entry_rank[t * K + lane];
        row = p.entry_row[t * K + lane];
        if (d >= 0 && write_weights) {
            const float w = topk_weights != nullptr ? topk_weights[t * K + lane] : 1.0f;
            region_at<float>(peers.ptr[d], recv_w_offset)[row] = w;
        }
    }
    const unsigned same = __match_any_sync(0xffffffffu, (lane < K && d >= 0) ? d : -1 - lane);
    const bool head = lane < K && d >= 0 && __ffs(same) - 1 == lane;
    return TokenEntries{d, row, __ballot_sync(0xffffffffu, head)};
}

// The (rank, row) of chain head k (a set bit of heads), broadcast to the whole warp.
FLATEP_DEVICE void head_target(const TokenEntries& e, int k, int* rank, int* row) {
    *rank = __shfl_sync(0xffffffffu, e.rank, k);
    *row = __shfl_sync(0xffffffffu, e.row, k);
}

}  // namespace flatep::kernels
