// The planner's algorithmic core (design §4): FLATEP_HD functions over raw int32 arrays and an explicit
// caller-provided workspace. No containers, no recursion, no allocation, no floating point, every tie broken by
// the lower index: the host wrapper (planner.cpp) and a CUDA kernel run this very code and get bitwise-equal plans.
//
// Entry points:
//   planner_workspace_words(l)           int32 words of workspace plan_alloc() needs
//   plan_alloc(l, kind, tpe_all, alloc, ws)  alloc[R][E] from the counts (constraints 1-3 of design §4)
//   derive_plan(l, p)                     keep, spill_start, take_start, group_row, slot_expert, cu_seqlens, stats
//
// Targets (how many entries each rank computes):
//   Exact mode: N = sum(tpe_all); rank r computes floor(N/R) + (r < N % R) (= S*K = C with full batches).
//   Slack mode: every load <= C. The greedy first derives fixed targets (ranks above C go to C; their excess is
//   handed to the ranks with the most room, each filled to C before the next, ties to the lower rank); the
//   transport candidates of the balanced planner only need every donor brought down to C and let any rank take
//   up to its room C - G_r.
//
// Every move takes entries of expert e away from its home rank h = e / epn and gives them to a replica on another
// rank; a replica is never the source of a further move. alloc[h][e] may reach 0 (the home group stays, empty).
//
// The core's parts: planner/executor.hpp (workspace, executor contract, SerialExec), quality.hpp (objectives and
// evaluation), greedy.hpp (home allocation, targets, one-donor greedy), candidates.hpp (the balanced planner's
// candidates, select_candidate, plan_alloc) and derive.hpp (derive_plan, on one thread or a GPU block). The GPU
// executors and kernels are planner/warp_exec.cuh and planner/gpu_planner.cu.
#pragma once

#include "planner/candidates.hpp"
#include "planner/derive.hpp"
#include "planner/executor.hpp"
#include "planner/greedy.hpp"
#include "planner/quality.hpp"
