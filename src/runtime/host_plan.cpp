#include "runtime/host_plan.hpp"

#include "host/plan_op.hpp"
#include "planner/planner.hpp"

namespace flatep::runtime {

void run_host_plan(const PlanArgs& a) {
    host::plan_counts_op(a);
    planner::plan_counts(a.layout, a.planner, a.plan, a.placement);
    planner::route_entries(a.layout, a.plan, a.rank, a.topk_idx, a.index_bytes, a.num_tokens);
    host::plan_routes_op(a);
}

}  // namespace flatep::runtime
