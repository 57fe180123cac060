// The planner (design §4): a pure function from tpe_all[R][E] (plus the static Layout) to a plan.
//
// The algorithmic core lives in planner_core.hpp as FLATEP_HD functions over raw arrays and an explicit
// workspace, so the CUDA planner runs the very same code and produces a bitwise-identical plan. This header is
// the host entry point used by the CPU backend, the flatep-plan tool, tests and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/layout.hpp"
#include "layout/plan.hpp"

namespace flatep::planner {

// A plan in host memory: one int32 allocation viewed through PlanView.
struct HostPlan {
    explicit HostPlan(const Layout& layout);
    HostPlan(const HostPlan&) = delete;
    HostPlan& operator=(const HostPlan&) = delete;
    Layout layout;
    std::vector<int32_t> storage;
    PlanView view;
};

// Global part: from p.tpe_all (filled by the caller) computes alloc, keep, spill_start, take_start, group_row,
// slot_expert, cu_seqlens and stats. Deterministic and identical on every rank. Throws on counts that do not fit
// the layout (a row sum above S*K, negative counts). The static planner reads its placement from `placement`, a
// table of make_placement_table (planner/static_placement.hpp); the other planners ignore it.
void plan_counts(const Layout& layout, PlannerKind kind, const PlanView& p, const int32_t* placement = nullptr);

// "the owner planner", "the static planner" or "a balancing planner": what a layout was made for (error messages).
const char* layout_kind_name(const Layout& layout);

// Per-rank part: destination rank and row of every entry of this rank's topk_idx[num_tokens][K] (int32 or int64,
// index_bytes 4 or 8), written to p.entry_rank / p.entry_row. Invalid ids get rank -1. Returns the flat index
// (t*K+k) of the first invalid id, or -1 if all are valid.
int64_t route_entries(const Layout& layout, const PlanView& p, int rank, const void* topk_idx, int index_bytes,
                      int num_tokens);

// Checks design §4's hard constraints 1-4 and the derived arrays (placement, cu_seqlens, stats) of a plan
// computed from p.tpe_all. Returns "" when the plan is valid, else a one-line description of the first violation.
// A static plan (layout.placed) is checked against the placement its slot table states (a valid placement, the split
// rule of design §4 "The static planner"), and against `placement` ([R][B] expert ids) when that is given.
std::string check_plan(const Layout& layout, const PlanView& p, const int32_t* placement = nullptr);

// Validates a count matrix for a layout: sizes, non-negative, every row sum <= S*K. Returns "" or the message.
std::string validate_counts(const Layout& layout, const int32_t* tpe_all);

}  // namespace flatep::planner
