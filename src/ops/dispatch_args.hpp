// Args of dispatch (design §3, §5): push each token row once per destination rank to its primary row, carry the
// routing weight of every entry, then on the destination fan duplicates out, zero padding and copy out.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct DispatchArgs {
    Layout layout;
    int rank;
    const uint16_t* x;          // [s][H] bf16 token rows of this rank (s = plan header's num_tokens)
    const float* topk_weights;  // [s][K] fp32 routing weights, or null (every weight 1)
    PlanView plan;              // this rank's plan (after plan op)
    uint8_t* peers[kMaxRanks];  // symmetric buffer bases
    uint16_t* recv_x;           // [NvS][H] bf16 out: rows grouped by expert; may be this rank's own recv region
    float* recv_w;              // [NvS] fp32 out: routing weight per row, 0 on padding; may be null
    // The receive region's row marks (SymmetricLayout::recv_marks_offset) are up to date: set by the Buffer once
    // its first device dispatch has run. Then, when recv_x is the region itself, the CUDA fan-out zeroes only the
    // padding rows not marked zero already; otherwise (false: a region nobody has marked yet) it zeroes every padding
    // row and marks every row. The CPU twin zeroes every padding row either way (same outputs).
    bool marks_valid;
    sync::SyncArgs sync;
};

// dispatch's contract, checked once per call for both backends. num_tokens: the plan's token count (x may be null
// when it is 0; recv_x never: other ranks' rows land there).
inline void check_dispatch_args(const DispatchArgs& a, int num_tokens) {
    check_op_rank("dispatch", a.rank, a.layout.num_ranks);
    check_given("dispatch", "x", a.x, num_tokens);
    check_given("dispatch", "recv_x", a.recv_x);
    check_aligned16("dispatch", "x", a.x);
    check_aligned16("dispatch", "recv_x", a.recv_x);
}

}  // namespace flatep
