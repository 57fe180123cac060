// check_plan is the oracle of every planner invariant test: each of its checks must fire, with its message, on a plan
// broken in exactly that way (a check that can never fire would let the invariant tests pass a wrong planner).
// The plans are corrupted by hand; the expected messages are written out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "planner/planner_core.hpp"
#include "planner_test_util.hpp"

namespace flatep {
namespace {

using test::make_test_layout;
using test::plan_of;

// R=2, E=4 (epn 2), S=4, K=2, tpe rows [6,1,1,0] and [4,2,0,2]: the golden plan of ExactTwoRanksOneReplica
// (alloc [5,3,0,0 | 5,0,1,2], one replica of e0 on rank 1). Its statistics, by hand: N = 16, 12 on their source,
// loads before [13, 3], after [8, 8], one replica in on rank 1, one out of rank 0.
TEST(CheckPlan, EveryStatisticIsChecked) {
    const Layout l = make_test_layout(2, 4, 4, 2);
    auto plan = plan_of(l, {6, 1, 1, 0, 4, 2, 0, 2}, PlannerKind::kBalanced);
    PlanView& p = plan->view;
    ASSERT_EQ(planner::check_plan(l, p), "");
    PlanStats& st = *p.stats;
    struct Field {
        const char* name;
        int64_t* wide;
        int32_t* narrow;
        int64_t want;
    };
    const Field fields[] = {
        {"entries_total", &st.entries_total, nullptr, 16},
        {"entries_on_source", &st.entries_on_source, nullptr, 12},
        {"entries_moved", &st.entries_moved, nullptr, 4},
        {"max_load_before", nullptr, &st.max_load_before, 13},
        {"max_load_after", nullptr, &st.max_load_after, 8},
        {"min_load_after", nullptr, &st.min_load_after, 8},
        {"loads_before[1]", nullptr, &st.loads_before[1], 3},
        {"loads_after[0]", nullptr, &st.loads_after[0], 8},
        {"replicas_in[1]", nullptr, &st.replicas_in[1], 1},
        {"replicas_out[0]", nullptr, &st.replicas_out[0], 1},
        {"replicas_in[2]", nullptr, &st.replicas_in[2], 0},  // past R: zero
        {"total_replicas", nullptr, &st.total_replicas, 1},
        {"max_replicas_in", nullptr, &st.max_replicas_in, 1},
        {"max_replicas_out", nullptr, &st.max_replicas_out, 1},
        {"makespan", nullptr, &st.makespan, 1},
    };
    for (const Field& f : fields) {
        const int64_t got = f.wide != nullptr ? *f.wide : *f.narrow;
        EXPECT_EQ(got, f.want) << f.name;
        if (f.wide != nullptr) {
            *f.wide += 1;
        } else {
            *f.narrow += 1;
        }
        EXPECT_EQ(planner::check_plan(l, p), "stats." + std::string(f.name) + " is " + std::to_string(f.want + 1) +
                                                 ", expected " + std::to_string(f.want));
        if (f.wide != nullptr) {
            *f.wide -= 1;
        } else {
            *f.narrow -= 1;
        }
        ASSERT_EQ(planner::check_plan(l, p), "") << "restoring " << f.name;
    }
}

// Allocations that conserve every expert but break balance (slack: above C) or the slot limit.
TEST(CheckPlan, SlackCapacityAndSlotLimit) {
    // Slack: R=2, E=4, S=4, K=2, factor 1.5: C = 12. The plan of SlackModeAndRoutingRows: alloc [9,3,0,0 | 1,0,1,2];
    // moving the replica's entry back home gives rank 0 13 > C entries.
    const Layout slack = make_test_layout(2, 4, 4, 2, 4, 1.5);
    auto plan = plan_of(slack, {6, 1, 1, 0, 4, 2, 0, 2}, PlannerKind::kBalanced);
    PlanView& p = plan->view;
    ASSERT_EQ(planner::check_plan(slack, p), "");
    p.alloc[0] += 1;
    p.alloc[4] -= 1;
    EXPECT_EQ(planner::check_plan(slack, p), "balance: rank 0 computes 13 entries, above capacity C = 12");

    // Slots: R=3, E=3 (epn 1), S=2, K=1, tpe rows [2,0,0], [0,2,0], [0,0,2]: home plan, loads 2 each. Rank 0 takes one
    // entry of e1 and one of e2 and gives one of e0 to each of ranks 1 and 2: loads stay 2, experts conserved, but
    // rank 0 now hosts two replicas with one slot.
    const Layout l = make_test_layout(3, 3, 2, 1);
    auto home = plan_of(l, {2, 0, 0, 0, 2, 0, 0, 0, 2}, PlannerKind::kGreedy);
    PlanView& q = home->view;
    ASSERT_EQ(planner::check_plan(l, q), "");
    const std::vector<int32_t> moved = {0, 1, 1, 1, 1, 0, 1, 0, 1};
    std::copy(moved.begin(), moved.end(), q.alloc);
    EXPECT_EQ(planner::check_plan(l, q), "slots: rank 0 hosts 2 replicas, more than epn = 1");
}

TEST(CheckPlan, PlannerNameOfAnUnknownKind) { EXPECT_STREQ(planner_name(PlannerKind(7)), "unknown"); }

// select_candidate given fewer qualities than num_candidates (a caller's short list): it considers only those.
TEST(CheckPlan, SelectCandidateReadsOnlyTheGivenCount) {
    namespace pc = planner;
    const pc::PlanQuality greedy{2, 3, 10};
    const pc::PlanQuality better{1, 1, 0};
    std::vector<pc::PlanQuality> q(pc::num_candidates(2), pc::PlanQuality{pc::kNoCandidate, 0, 0});
    q[2] = better;                                           // a path candidate
    q[pc::kNumPathVariants + 1] = pc::PlanQuality{1, 1, 5};  // transport v1, budget 1: worse on entries moved
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), int(q.size())), 2);
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), 2), -1);  // only candidates 0 and 1: none acceptable
    q[0] = pc::PlanQuality{2, 3, 9};                           // as good as the greedy on P and replicas, fewer moved
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), 1), 0);
    q[pc::kNumPathVariants + 1] = pc::PlanQuality{1, 1, 0};  // ties with candidate 2: the earlier one stays
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), int(q.size())), 2);
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), pc::kNumPathVariants + 2), 2);
    q[2] = pc::PlanQuality{pc::kNoCandidate, 0, 0};
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), pc::kNumPathVariants + 1), 0);  // the budget-1 one cut off
    EXPECT_EQ(pc::select_candidate(greedy, q.data(), pc::kNumPathVariants + 2), pc::kNumPathVariants + 1);
}

}  // namespace
}  // namespace flatep
