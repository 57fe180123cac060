// Args of entry_values: the reverse path of one fp32 value per row. Each destination publishes a value per row
// (e.g. dL/d(routing weight) computed next to the expert output); each source reads back the value of every one of
// its entries (t, k). This is how the gradient of the routing weights returns to the tokens' ranks.
#pragma once

#include <cstdint>

#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
#include "sync/sync.hpp"

namespace flatep {

struct EntryValuesArgs {
    Layout layout;
    int rank;
    const float* row_values;  // [NvS] fp32 values of this rank's rows
    PlanView plan;
    uint8_t* peers[kMaxRanks];  // symmetric buffer bases (the recv_w region carries the values)
    float* out;                 // [s][K] fp32 out: value of each entry's row; 0 for invalid entries
    sync::SyncArgs sync;
};

// entry_values' contract, checked once per call for both backends. num_tokens: the plan's token count (out may be
// null when it is 0; row_values never: other ranks read this rank's rows).
inline void check_entry_values_args(const EntryValuesArgs& a, int num_tokens) {
    check_op_rank("entry_values", a.rank, a.layout.num_ranks);
    check_given("entry_values", "row_values", a.row_values);
    check_given("entry_values", "out", a.out, num_tokens);
}

namespace host {

// The CPU twin (src/host/entry_values.cpp). Runs rank args.rank's part; collective.
//   barrier; destination side: copy row_values of this rank's real rows into its symmetric recv_w region;
//   barrier; source side: out[t*K+k] = the value at entry (t,k)'s row on its destination rank (0 for an entry
//   whose expert id was invalid).
void run(const EntryValuesArgs& args);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/entry_values): same contract and outputs as host::run (bitwise: copies
// only). Collective. Kernels: entry barrier -> publish this rank's real-row values into its symmetric recv_w region ->
// barrier -> every entry of this rank reads the value at its row on its destination rank.
void launch(const EntryValuesArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
