// CPU twin of the plan op (design §3, §4): local histogram, all-gather of counts through symmetric memory, the
// host planner, routing of this rank's entries, and the push of row-chain metadata to the destinations.
#pragma once

#include "ops/plan_args.hpp"

namespace flatep::host {

// Runs rank args.rank's part; collective (every rank calls it with the same layout and planner).
//   1. histogram of topk_idx[num_tokens][K]; ids outside [0, E) are skipped and the first one is recorded in the
//      status words (kStatusBadExpert, flat index t*K+k, value)
//   2. barrier; write the counts into row `rank` of every peer's tpe_all region; barrier
//   3. copy tpe_all into the plan; plan_counts(); route_entries()
//   4. for every token and destination d, the entries going to d in ascending k form a chain: write d's staging
//      row_head[row] = first row of the chain and row_next[row] = next row or -1; barrier
//   5. copy the staging of the real rows of every group into plan.row_head/row_next; -1 on every other row
//   6. header: num_tokens, planner (the runtime stamps the generation)
void plan_op(const PlanArgs& args);

}  // namespace flatep::host
