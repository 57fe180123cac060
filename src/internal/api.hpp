// FlatEP's internal API: everything its own bindings, tools, benchmarks and tests use beyond the public headers of
// include/flatep/, in one header, so that what they reach into is listed in one place (docs/design.md §10;
// scripts/check_layers.py holds bindings/, tools/ and benchmarks/ to include/flatep/ and this header). Not for
// users: it follows the library's insides and may change with any commit.
#pragma once

#include "common/bf16.hpp"       // bf16 <-> float (round to nearest even), as the CPU backend rounds
#include "common/check.hpp"      // FLATEP_CHECK / FLATEP_THROW: one-line flatep::Error
#include "common/env.hpp"        // the FLATEP_* variables and the checks of their values (num_sms, timeouts)
#include "layout/layout.hpp"     // Layout, make_layout, ViewShape: every size a config derives
#include "layout/plan.hpp"       // PlanView, make_plan_sizes: the arrays of a plan and where they sit
#include "planner/planner.hpp"   // the host planner: HostPlan, plan_counts, route_entries, check_plan
#include "routing/routing.hpp"   // the routing generator of design §9
#include "runtime/internal.hpp"  // the Buffer's and Plan's insides: layout, host plan, CPU op counters

#if defined(__CUDACC__)
// The kernel level, for CUDA programs only: the kernel microbenchmarks' one helper (benchmarks/common/kernel_step.cuh,
// the one place outside src/ that fills op Args), the GPU planner's and the FP8 rule's tests, and the start gate of
// ep_bench_multi: the op Args and their launchers, the plan op's phases, the GPU planner, virtual ranks on one GPU
// (LocalDeviceGroup) and the device barrier.
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/plan/plan.cuh"
#include "ops/combine_args.hpp"
#include "ops/dispatch_args.hpp"
#include "ops/dispatch_fp8_args.hpp"
#include "ops/grad_reduce_args.hpp"
#include "ops/prefetch_args.hpp"
#include "planner/candidates.hpp"
#include "planner/gpu_planner.cuh"
#include "runtime/device_ops.hpp"
#include "sync/sync.hpp"
#include "testing/local_device.hpp"
#endif
