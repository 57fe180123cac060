// CPU twin of dispatch (design §3, §5).
#pragma once

#include "host/op_stats.hpp"
#include "kernels/dispatch/dispatch_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective.
//   barrier; source side: for each token and destination d, copy the bf16 row once to d's symmetric recv_x at the
//   chain head row (dedup) and write every entry's weight (1 when topk_weights is null) to d's recv_w at its row;
//   barrier; destination side: every real row r gets recv_x[r] = symmetric recv_x[row_head[r]] and
//   recv_w[r] = symmetric recv_w[r]; padding rows of every group are zero (weight 0); rows past the last group end
//   are not touched. recv_x / recv_w may alias this rank's symmetric regions.
void dispatch(const DispatchArgs& args, OpStats* stats = nullptr);

}  // namespace flatep::host
