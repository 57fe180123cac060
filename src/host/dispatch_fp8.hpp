// CPU twin of dispatch_fp8 (design §3, §5, §6).
#pragma once

#include "host/op_stats.hpp"
#include "ops/dispatch_fp8_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective. The same steps as host::dispatch with FP8 rows:
//   barrier; source side: for each token and destination d, its e4m3 row and scales once into d's symmetric FP8
//   rows at the chain head row (bf16 input: quantised by the design §6 rule into the first destination's row, then
//   copied from there to the others; pre-quantised input: copied as given), every entry's weight (1 when topk_weights
//   is null) into d's recv_w at its row;
//   barrier; destination side: every real row r gets the e4m3 row and scales of its chain head and its weight;
//   padding rows of every group get zero bytes, zero scales and weight 0; rows past the last group end are not
//   touched. recv_x / recv_scales may alias this rank's symmetric FP8 rows and scales.
void dispatch_fp8(const DispatchFp8Args& args, OpStats* stats = nullptr);

}  // namespace flatep::host
