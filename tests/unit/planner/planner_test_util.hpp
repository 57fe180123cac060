// Helpers shared by the planner tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "flatep/config.hpp"
#include "flatep/error.hpp"
#include "layout/layout.hpp"
#include "planner/planner.hpp"

namespace flatep::test {

inline Layout make_test_layout(int R, int E, int S, int K, int align = 1, double capacity_factor = 1.0) {
    Config c;
    c.num_ranks = R;
    c.num_experts = E;
    c.num_tokens = S;
    c.topk = K;
    c.hidden = 8;
    c.align = align;
    c.capacity_factor = capacity_factor;
    return make_layout(c);
}

// A layout with B = num_slots slots (-1: epn) and view stride Q (0: epn), for `planner`.
inline Layout layout_of(int R, int E, int S, int K, int align, int num_slots, int view_stride = 0,
                        PlannerKind planner = PlannerKind::kBalanced, double capacity_factor = 1.0) {
    Config c;
    c.num_ranks = R;
    c.num_experts = E;
    c.num_tokens = S;
    c.topk = K;
    c.align = align;
    c.capacity_factor = capacity_factor;
    return make_layout(c, planner, {.num_slots = num_slots, .view_stride = view_stride});
}

// Plans `counts` with `kind`; the plan is returned for inspection.
inline std::unique_ptr<planner::HostPlan> plan_of(const Layout& l, const std::vector<int32_t>& counts,
                                                  PlannerKind kind) {
    auto plan = std::make_unique<planner::HostPlan>(l);
    std::copy(counts.begin(), counts.end(), plan->view.tpe_all);
    planner::plan_counts(l, kind, plan->view);
    return plan;
}

// The message of the flatep::Error fn() throws, or "(no error)".
template <class F>
std::string error_of(F&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.message();
    }
    return "(no error)";
}

inline std::vector<int32_t> copy_of(const int32_t* p, int64_t n) { return std::vector<int32_t>(p, p + n); }

inline std::string describe(const Layout& l, PlannerKind kind) {
    return std::string(planner_name(kind)) + " R=" + std::to_string(l.num_ranks) +
           " E=" + std::to_string(l.num_experts) + " S=" + std::to_string(l.num_tokens) +
           " K=" + std::to_string(l.topk) + " align=" + std::to_string(l.align) + " C=" + std::to_string(l.capacity);
}

}  // namespace flatep::test
