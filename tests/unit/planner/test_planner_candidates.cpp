// The balanced planner decomposed as the GPU runs it: every candidate built independently with a fresh workspace,
// then select_candidate over their qualities, then the winner rebuilt. It must give plan_alloc's allocation bitwise.
#include <gtest/gtest.h>

#include <vector>

#include "flatep/config.hpp"
#include "planner/planner_core.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

std::vector<int32_t> parallel_plan_alloc(const Layout& l, const std::vector<int32_t>& tpe) {
    const int64_t words = planner_core::planner_workspace_words(l);
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    std::vector<int32_t> alloc(re), ws(words);
    const planner_core::Workspace w = planner_core::make_workspace(l, ws.data());
    planner_core::greedy_alloc(l, tpe.data(), alloc.data(), w);
    const planner_core::PlanQuality greedy =
        planner_core::evaluate_alloc(l, tpe.data(), alloc.data(), w.num_in, w.num_out);
    const int count = planner_core::num_candidates(greedy.makespan);
    std::vector<planner_core::PlanQuality> quality(count);
    // Built in reverse order, each with its own poisoned workspace: no candidate may depend on another's leftovers.
    for (int i = count - 1; i >= 0; --i) {
        std::vector<int32_t> own(words, -7), cand(re, -7);
        const planner_core::Workspace wi = planner_core::make_workspace(l, own.data());
        quality[i] = planner_core::build_candidate(l, tpe.data(), cand.data(), wi, i)
                         ? planner_core::evaluate_alloc(l, tpe.data(), cand.data(), wi.num_in, wi.num_out)
                         : planner_core::PlanQuality{planner_core::kNoCandidate, 0, 0};
    }
    const int kept = planner_core::select_candidate(greedy, quality.data(), count);
    if (kept >= 0) {
        std::vector<int32_t> own(words, -7);
        const planner_core::Workspace wk = planner_core::make_workspace(l, own.data());
        EXPECT_TRUE(planner_core::build_candidate(l, tpe.data(), alloc.data(), wk, kept));
    }
    return alloc;
}

TEST(PlannerCandidates, IndependentBuildsAndSelectionEqualTheSerialPlanner) {
    int cases = 0, kept_non_greedy = 0;
    for (int R : {2, 4, 8, 16}) {
        for (int epn : {1, 3, 8}) {
            for (double sigma : {0.0, 0.8, 2.0}) {
                for (double factor : {1.0, 1.1}) {
                    for (uint64_t seed : {1u, 2u}) {
                        Config c;
                        c.num_ranks = R, c.num_experts = R * epn, c.num_tokens = 64, c.topk = std::min(4, R * epn);
                        c.capacity_factor = factor;
                        const Layout l = make_layout(c);
                        const std::vector<int32_t> tpe =
                            routing::generate_counts(R, c.num_experts, c.num_tokens, c.topk, sigma, seed);
                        std::vector<int32_t> serial(int64_t(R) * c.num_experts);
                        std::vector<int32_t> ws(planner_core::planner_workspace_words(l));
                        planner_core::plan_alloc(l, PlannerKind::kBalanced, tpe.data(), serial.data(), ws.data());
                        std::vector<int32_t> greedy(serial.size());
                        planner_core::plan_alloc(l, PlannerKind::kGreedy, tpe.data(), greedy.data(), ws.data());
                        const std::vector<int32_t> parallel = parallel_plan_alloc(l, tpe);
                        ASSERT_EQ(parallel, serial) << "R=" << R << " epn=" << epn << " sigma=" << sigma
                                                    << " factor=" << factor << " seed=" << seed;
                        kept_non_greedy += parallel != greedy;
                        ++cases;
                    }
                }
            }
        }
    }
    EXPECT_EQ(cases, 144);
    EXPECT_GT(kept_non_greedy, 20);  // the comparison must exercise candidates, not only the greedy
}

}  // namespace
}  // namespace flatep
