// The CPU backend's plan op: the host twin's counts (histogram, all-gather), the host planner and this rank's
// routing, then the twin's row chains and unpack (host/plan_op.hpp, planner/planner.hpp). The runtime wires the two
// so that neither includes the other, as device::launch_plan does on the GPU.
#pragma once

#include "ops/plan_args.hpp"

namespace flatep::runtime {

// Rank args.rank's plan op on the host; collective (every rank calls it with the same layout and planner).
void run_host_plan(const PlanArgs& args);

}  // namespace flatep::runtime
