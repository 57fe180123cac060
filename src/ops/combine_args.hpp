// Args of combine (design §3, §6): each destination sums, per (source, token), its rows in ascending k in fp32
// (optionally weighted, fmaf) and rounds the partial to bf16; each source pulls its partials and adds them in
// ascending destination rank in fp32, rounding to bf16 once.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct CombineArgs {
    Layout layout;
    int rank;
    const uint16_t* y;     // [NvS][H] bf16 expert outputs of this rank's rows
    const float* weights;  // [NvS] fp32 per-row weights for a weighted combine, or null (unweighted)
    PlanView plan;
    uint8_t* peers[kMaxRanks];
    uint16_t* out;  // [s][H] bf16 out, one row per token of this rank
    // No entry barrier. This step's plan op and dispatch (stream-ordered before this combine on every rank) met every
    // rank after its previous combine's pulls of the partials, so none can still be reading this rank's partials. The
    // caller promises that no other op ran on the Buffer between that dispatch and this combine (another combine
    // between them, of this plan or another, would still be pulling).
    bool plan_ordered;
    sync::SyncArgs sync;
};

// combine's contract, checked once per call for both backends. num_tokens: the plan's token count (s; out may be null
// when it is 0: a rank with no tokens still computes the rows other ranks sent it, so y is always needed).
inline void check_combine_args(const CombineArgs& a, int num_tokens) {
    check_op_rank("combine", a.rank, a.layout.num_ranks);
    check_given("combine", "y", a.y);
    check_given("combine", "out", a.out, num_tokens);
    check_aligned16("combine", "y", a.y);
    check_aligned16("combine", "out", a.out);
}

namespace host {

// The CPU twin (src/host/combine.cpp). Numerics, which every CUDA kernel must reproduce bitwise:
//   destination, per chain (one per (source, token) on this rank) with head row h, over each element:
//     acc = 0.0f; for r along the chain (ascending k): acc = weights ? fma(weights[r], y[r], acc) : acc + y[r];
//     partial[h] = bf16(acc)
//   source, per token t: acc = 0.0f; for d ascending with entries of t: acc += float(partial_d[head row of t on d]);
//     out[t] = bf16(acc)   (a token without any valid entry gets a zero row)
// src/host is compiled with -ffp-contract=off so the compiler never fuses the unweighted adds.
// Runs rank args.rank's part; collective. Barriers: entry (none when plan_ordered), then between the destination and
// source sides.
void run(const CombineArgs& args, OpStats* stats = nullptr);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/combine): same contract and outputs as host::run (bitwise).
// Collective. Kernels: entry barrier (none when plan_ordered) -> partials on the destination (per chain head: fp32 sum
// of the chain's rows in ascending k, fmaf when weighted, rounded to bf16 into the symmetric partial region) -> barrier
// -> pull on the source (warp per token: one read per destination rank, fp32 sum in ascending rank, one bf16 rounding).
void launch(const CombineArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
