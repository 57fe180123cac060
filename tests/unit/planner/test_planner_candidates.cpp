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
    const int64_t words = planner::planner_workspace_words(l);
    const int64_t re = int64_t(l.num_ranks) * l.num_experts;
    std::vector<int32_t> alloc(re), ws(words);
    const planner::Workspace w = planner::make_workspace(l, ws.data());
    planner::greedy_alloc(l, tpe.data(), alloc.data(), w);
    const planner::PlanQuality greedy = planner::evaluate_alloc(l, tpe.data(), alloc.data(), w.num_in, w.num_out);
    const int count = planner::num_candidates(greedy.makespan);
    std::vector<planner::PlanQuality> quality(count);
    // Built in reverse order, each with its own poisoned workspace: no candidate may depend on another's leftovers.
    for (int i = count - 1; i >= 0; --i) {
        std::vector<int32_t> own(words, -7), cand(re, -7);
        const planner::Workspace wi = planner::make_workspace(l, own.data());
        quality[i] = planner::build_candidate(l, tpe.data(), cand.data(), wi, i)
                         ? planner::evaluate_alloc(l, tpe.data(), cand.data(), wi.num_in, wi.num_out)
                         : planner::PlanQuality{planner::kNoCandidate, 0, 0};
    }
    const int kept = planner::select_candidate(greedy, quality.data(), count);
    if (kept >= 0) {
        std::vector<int32_t> own(words, -7);
        const planner::Workspace wk = planner::make_workspace(l, own.data());
        EXPECT_TRUE(planner::build_candidate(l, tpe.data(), alloc.data(), wk, kept));
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
                        std::vector<int32_t> ws(planner::planner_workspace_words(l));
                        planner::plan_alloc(l, PlannerKind::kBalanced, tpe.data(), serial.data(), ws.data());
                        std::vector<int32_t> greedy(serial.size());
                        planner::plan_alloc(l, PlannerKind::kGreedy, tpe.data(), greedy.data(), ws.data());
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

// An executor that visits for_each / sum items in reverse and scans arg_max from the top (keeping the lower index
// on ties). The GPU's warp executor runs for_each and sum bodies in an unspecified order across lanes, so the plan
// must not depend on that order: every candidate and the greedy must come out as with SerialExec.
struct ReverseExec : planner::SerialExec {
    template <class F>
    void for_each(int n, F&& f) const {
        for (int i = n - 1; i >= 0; --i) f(i);
    }
    template <class F>
    int64_t sum(int n, F&& f) const {
        int64_t s = 0;
        for (int i = n - 1; i >= 0; --i) s += int64_t(f(i));
        return s;
    }
    template <class K>
    int arg_max(int n, K&& key) const {
        uint64_t best = 0;
        int at = -1;
        for (int i = n - 1; i >= 0; --i) {
            const uint64_t k = key(i);
            if (k != 0 && k >= best) {
                best = k;
                at = i;
            }
        }
        return at;
    }
};

TEST(PlannerCandidates, ExecutionOrderDoesNotChangeAnyCandidate) {
    int compared = 0;
    for (int R : {2, 5, 8}) {
        for (int epn : {1, 4, 48}) {
            for (double sigma : {0.0, 1.0, 3.0}) {
                for (double factor : {1.0, 1.25}) {
                    Config c;
                    c.num_ranks = R, c.num_experts = R * epn, c.num_tokens = 256, c.topk = std::min(8, R * epn);
                    c.capacity_factor = factor;
                    const Layout l = make_layout(c);
                    const std::vector<int32_t> tpe =
                        routing::generate_counts(R, c.num_experts, c.num_tokens, c.topk, sigma, 7);
                    const int64_t words = planner::planner_workspace_words(l);
                    const int64_t re = int64_t(R) * c.num_experts;
                    std::vector<int32_t> ws_a(words, -3), ws_b(words, -5), a(re), b(re);
                    const planner::Workspace wa = planner::make_workspace(l, ws_a.data());
                    const planner::Workspace wb = planner::make_workspace(l, ws_b.data());
                    planner::greedy_alloc(planner::SerialExec{}, l, tpe.data(), a.data(), wa);
                    planner::greedy_alloc(ReverseExec{}, l, tpe.data(), b.data(), wb);
                    ASSERT_EQ(a, b) << "greedy R=" << R << " epn=" << epn << " sigma=" << sigma;
                    const planner::PlanQuality qa =
                        planner::evaluate_alloc(planner::SerialExec{}, l, tpe.data(), a.data(), wa.num_in, wa.num_out);
                    const planner::PlanQuality qb =
                        planner::evaluate_alloc(ReverseExec{}, l, tpe.data(), b.data(), wb.num_in, wb.num_out);
                    ASSERT_EQ(qa.makespan, qb.makespan);
                    ASSERT_EQ(qa.total_replicas, qb.total_replicas);
                    ASSERT_EQ(qa.entries_moved, qb.entries_moved);
                    for (int i = 0; i < planner::num_candidates(qa.makespan + 1); ++i) {
                        const bool ok_a =
                            planner::build_candidate(planner::SerialExec{}, l, tpe.data(), a.data(), wa, i);
                        const bool ok_b = planner::build_candidate(ReverseExec{}, l, tpe.data(), b.data(), wb, i);
                        ASSERT_EQ(ok_a, ok_b) << "candidate " << i << " R=" << R << " epn=" << epn;
                        if (ok_a) ASSERT_EQ(a, b) << "candidate " << i << " R=" << R << " epn=" << epn;
                        ++compared;
                    }
                }
            }
        }
    }
    EXPECT_GT(compared, 1000);
}

}  // namespace
}  // namespace flatep
