// CPU twin of the plan op's kernels (design §3, §4): local histogram, all-gather of counts through symmetric memory,
// and the push of row-chain metadata to the destinations; the host planner and the routing of this rank's entries
// run between them (src/planner).
#pragma once

#include "ops/plan_args.hpp"

namespace flatep::host {

// Rank args.rank's part, in two halves around the host planner (the runtime runs the three in order:
// run_host_plan in runtime/host_plan.hpp, as device::launch_plan does for the kernels and the GPU planner); both
// collective (every rank calls them with the same layout and planner).
// plan_counts_op:
//   1. histogram of topk_idx[num_tokens][K]; ids outside [0, E) are skipped and the first one is recorded in the
//      status words (sync::kStatusBadExpert, flat index t*K+k, value)
//   2. barrier; write the counts into row `rank` of every peer's tpe_all region; barrier; copy tpe_all into the plan
// (the planner: planner::plan_counts(), planner::route_entries())
// plan_routes_op:
//   4. for every token and destination d, the entries going to d in ascending k form a chain: write d's staging
//      row_head[row] = first row of the chain and row_next[row] = next row or -1; barrier
//   5. copy the staging of the real rows of every group into plan.row_head/row_next; -1 on every other row
//   6. header: num_tokens, planner (the runtime stamps the generation)
void plan_counts_op(const PlanArgs& args);
void plan_routes_op(const PlanArgs& args);

}  // namespace flatep::host
