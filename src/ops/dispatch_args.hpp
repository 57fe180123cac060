// Args of dispatch (design §3, §5): push each token row once per destination rank to its primary row, carry the
// routing weight of every entry, then on the destination fan duplicates out, zero padding and copy out.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
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
    // No entry barrier. The plan op of this step (stream-ordered before this dispatch on every rank) met every rank
    // after its previous reads of the receive region, so no destination can still be reading it. The caller promises
    // that this dispatch is the first op on the Buffer since that plan op, and that every earlier read of the region
    // (an FFN on zero-copy rows) is stream-ordered before that plan op on every rank (serving: plan, dispatch, FFN,
    // combine on one stream).
    bool plan_ordered;
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

namespace host {

// The CPU twin (src/host/dispatch.cpp; the source and destination sides it shares with dispatch_fp8 are in
// host/dispatch.hpp). Runs rank args.rank's part; collective.
//   barrier (none when plan_ordered); source side: for each token and destination d, copy the bf16 row once to d's
//   symmetric recv_x at the chain head row (dedup) and write every entry's weight (1 when topk_weights is null) to d's
//   recv_w at its row; barrier; destination side: every real row r gets recv_x[r] = symmetric recv_x[row_head[r]] and
//   recv_w[r] = symmetric recv_w[r]; padding rows of every group are zero (weight 0); rows past the last group end
//   are not touched. recv_x / recv_w may alias this rank's symmetric regions.
void run(const DispatchArgs& args, OpStats* stats = nullptr);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/dispatch): same contract and outputs as host::run (bitwise).
// Collective. Kernels: entry barrier (none when plan_ordered) -> push (one 16-byte-vectorised store stream per (token,
// destination rank), one weight per entry) -> barrier -> fan-out on the destination (duplicates copied from their chain
// head, the copy-out when recv_x is not the symmetric region, weights, zeroed padding).
void launch(const DispatchArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
