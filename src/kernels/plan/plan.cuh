// CUDA plan op (design §3, §4), the kernels' part: the histogram and all-gather of the counts through symmetric
// memory before the planner, the routing of this rank's entries in (token, k) order with the push of the row-chain
// metadata to the destinations, and the unpack after it. The planner between them is planner/gpu_planner.cuh; the
// runtime wires the launches (runtime/device_ops.cpp: device::launch_plan). Kernels, in order:
// histogram -> all-gather + barrier -> [planner] -> routing + chain push -> barrier -> chain unpack. A call of at
// most 8192 entries runs the histogram and the all-gather as one kernel, and a routing grid of one block meets the
// peers itself: the kernels' part of a decode call is three launches a rank where a prefill call's is seven.
// No host synchronisation: graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flatep/types.hpp"
#include "layout/layout.hpp"
#include "layout/plan.hpp"
#include "ops/plan_args.hpp"

namespace flatep::kernels {

// Device scratch of these kernels (this rank's histogram, the segments' counts, the first bad expert id), in bytes.
size_t plan_kernels_workspace_bytes(const Layout& layout);

// Checks the Args (throws on the first bad one) and returns the op's workspace: args.workspace, or (null) a scratch
// of `workspace_bytes` the kernels library keeps for args.rank (allocated on first use outside stream capture).
void* prepare_plan(const PlanArgs& args, size_t workspace_bytes, cudaStream_t stream);

// Before the planner: the histogram of args.topk_idx and the all-gather of every rank's counts into
// args.plan.tpe_all (and the plan's header). Collective: every rank launches it on its own stream. `workspace`:
// plan_kernels_workspace_bytes(layout) bytes, kept for launch_plan_routes.
void launch_plan_counts(const PlanArgs& args, void* workspace, cudaStream_t stream, int num_sms);

// After the planner wrote the plan's global part: routing and chain push, barrier, chain unpack and the status word
// of the first bad expert id. `workspace`: launch_plan_counts'.
void launch_plan_routes(const PlanArgs& args, void* workspace, cudaStream_t stream, int num_sms);

}  // namespace flatep::kernels
