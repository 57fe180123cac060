// CUDA plan op (design §3, §4): histogram, all-gather of the counts through symmetric memory, the planner on the
// GPU (bitwise the plan of planner_core.hpp / host::plan_op), routing of this rank's entries in (token, k) order,
// and the push of the row-chain metadata to the destinations. No host synchronisation: graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flatep/types.hpp"
#include "kernels/plan/plan_args.hpp"
#include "layout/layout.hpp"
#include "planner/plan.hpp"

namespace flatep::kernels {

// Device scratch the plan op needs (PlanArgs::workspace), in bytes.
size_t plan_workspace_bytes(const Layout& layout);

// The whole plan op of args.rank on `stream` (collective: every rank launches it on its own stream). Kernels:
// histogram -> all-gather + barrier -> planner -> routing + chain push -> barrier -> chain unpack.
void launch(const PlanArgs& args, cudaStream_t stream);

// How the planner step runs on the GPU.
enum class PlannerEngine : int {
    kParallel = 0,  // planner_core on warp executors: one warp per balanced-planner candidate (the default)
    kSerial = 1,    // one thread calling planner_core::plan_alloc / derive_plan as written (reference; slow)
};

// Only the planner step: from plan.tpe_all (already in device memory) computes the global part of the plan.
// For benchmarks and tests. `workspace` as for PlanArgs (plan_workspace_bytes), not null.
void launch_planner(const Layout& layout, PlannerKind kind, const PlanView& plan, void* workspace, PlannerEngine engine,
                    cudaStream_t stream);

// Engine used by launch(const PlanArgs&) (process-wide; default kParallel).
void set_planner_engine(PlannerEngine engine);

}  // namespace flatep::kernels
