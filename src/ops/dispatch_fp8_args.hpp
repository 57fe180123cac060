// Args of dispatch_fp8 (design §3, §5, §6): dispatch of e4m3 rows with one fp32 scale per 128 channels. The same plan,
// chains, receive layout and weights as dispatch; rows are quantised by the source before they are pushed (bf16
// input) or pushed as given (pre-quantised input), so a row crosses to its destination as H + H/32 bytes instead of
// 2H.
#pragma once

#include <cstdint>

#include "common/check.hpp"
#include "flatep/fp8.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct DispatchFp8Args {
    Layout layout;  // hidden % 128 == 0
    int rank;
    const uint16_t* x_bf16;     // [s][H] bf16 token rows, quantised on the way out; or null
    const uint8_t* x_fp8;       // [s][H] e4m3 token rows (pre-quantised); or null. Exactly one of x_bf16 / x_fp8
    const float* x_scales;      // [s][H/128] fp32 scales of x_fp8; null with x_bf16
    const float* topk_weights;  // [s][K] fp32 routing weights, or null (every weight 1)
    Fp8Scale scale_mode;        // how x_bf16's scales are chosen (unused with x_fp8: its scales move as given)
    PlanView plan;              // this rank's plan (after plan op)
    uint8_t* peers[kMaxRanks];  // symmetric buffer bases
    uint8_t* recv_x;            // [NvS][H] e4m3 out; may be this rank's symmetric FP8 rows (fp8_recv_x_offset)
    float* recv_scales;         // [NvS][H/128] fp32 out; may be this rank's symmetric scales (fp8_recv_scales_offset)
    float* recv_w;              // [NvS] fp32 out: routing weight per row, 0 on padding; may be null
    bool plan_ordered;          // no entry barrier: as DispatchArgs::plan_ordered
    sync::SyncArgs sync;
};

// Where a rank's symmetric buffer stages FP8 rows: inside the bf16 receive region ([NvS][H] bf16 = 2*NvS*H bytes),
// which holds the [NvS][H] e4m3 rows followed by their [NvS][H/128] fp32 scales (NvS*H*33/32 bytes). A bf16 dispatch
// and an FP8 dispatch share it: each op rewrites what it reads.
FLATEP_HD int64_t fp8_recv_x_offset(const SymmetricLayout& sym) { return sym.recv_x_offset; }
FLATEP_HD int64_t fp8_recv_scales_offset(const Layout& l, const SymmetricLayout& sym) {
    return sym.recv_x_offset + int64_t(l.num_recv_rows) * l.hidden;  // a multiple of 128 bytes past an aligned base
}
FLATEP_HD int fp8_num_blocks(const Layout& l) { return l.hidden / kFp8BlockSize; }

// dispatch_fp8's contract, checked once per call for both backends: kInvalidArgument naming the argument.
// num_tokens: the plan's token count (the rows may be null when it is 0).
inline void check_dispatch_fp8_args(const DispatchFp8Args& a, int num_tokens) {
    FLATEP_CHECK(a.layout.hidden % kFp8BlockSize == 0, "dispatch_fp8: hidden (H) must be a multiple of ", kFp8BlockSize,
                 " for FP8 rows (one scale per ", kFp8BlockSize, " channels), got H=", a.layout.hidden);
    FLATEP_CHECK(a.x_bf16 == nullptr || a.x_fp8 == nullptr,
                 "dispatch_fp8: pass x_bf16 (quantised in the op) or x_fp8 with x_scales, not both");
    FLATEP_CHECK(a.x_fp8 == nullptr || a.x_scales != nullptr,
                 "dispatch_fp8: x_scales is null; x_fp8 needs its [s][H/128] fp32 scales");
    FLATEP_CHECK(a.x_scales == nullptr || a.x_fp8 != nullptr,
                 "dispatch_fp8: x_scales is set without x_fp8; bf16 rows (x_bf16) get their scales in the op");
    FLATEP_CHECK(num_tokens == 0 || a.x_bf16 != nullptr || a.x_fp8 != nullptr,
                 "dispatch_fp8: x_bf16 and x_fp8 are both null; pass one of them");
    FLATEP_CHECK(a.scale_mode == Fp8Scale::kFloat || a.scale_mode == Fp8Scale::kUe8m0,
                 "dispatch_fp8: scale_mode must be Fp8Scale::kFloat (0) or kUe8m0 (1), got ", int(a.scale_mode));
    check_given("dispatch_fp8", "recv_x", a.recv_x);
    check_given("dispatch_fp8", "recv_scales", a.recv_scales);
    check_op_rank("dispatch_fp8", a.rank, a.layout.num_ranks);
    check_aligned16("dispatch_fp8", "x_bf16", a.x_bf16);
    check_aligned16("dispatch_fp8", "x_fp8", a.x_fp8);
    check_aligned16("dispatch_fp8", "recv_x", a.recv_x);
    FLATEP_CHECK(is_aligned(a.x_scales, 4) && is_aligned(a.recv_scales, 4),
                 "dispatch_fp8: x_scales and recv_scales must be 4-byte aligned");
}

namespace host {

// The CPU twin (src/host/dispatch_fp8.cpp). Runs rank args.rank's part; collective. The same steps as
// host::run(const DispatchArgs&) with FP8 rows:
//   barrier (none when plan_ordered); source side: for each token and destination d, its e4m3 row and scales once into
//   d's symmetric FP8 rows at the chain head row (bf16 input: quantised by the design §6 rule into the first
//   destination's row, then copied from there to the others; pre-quantised input: copied as given), every entry's
//   weight (1 when topk_weights is null) into d's recv_w at its row; barrier; destination side: every real row r gets
//   the e4m3 row and scales of its chain head and its weight; padding rows of every group get zero bytes, zero scales
//   and weight 0; rows past the last group end are not touched. recv_x / recv_scales may alias this rank's symmetric
//   FP8 rows and scales.
void run(const DispatchFp8Args& args, OpStats* stats = nullptr);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/dispatch/dispatch_fp8.cu): same contract and outputs as host::run
// (bitwise). Collective. Kernels: entry barrier (none when plan_ordered) -> push (warp per token: the bf16 row is
// quantised once, in registers, then its e4m3 bytes and scales are stored to every destination rank's chain-head row;
// pre-quantised rows are copied as they are; one weight per entry) -> barrier -> fan-out on the destination (duplicates
// copied from their chain head, the copy-out when recv_x / recv_scales are not the symmetric region, weights, zeroed
// padding rows and scales).
void launch(const DispatchFp8Args& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
