// route_entries (planner/planner.hpp) asked for a rank outside the world: refused with the plan op's message, after
// the inputs' own checks; the same plan routes a rank inside the world to the rows its placement gives.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "planner_test_util.hpp"

namespace flatep {
namespace {

// R=2, E=4 (epn 2), S=4, K=2, rows [6,1,1,0 | 4,2,0,2]: the plan of ExactTwoRanksOneReplica.
TEST(RouteEntriesRank, ARankOutsideTheWorldIsRefused) {
    const Layout l = test::make_test_layout(2, 4, 4, 2);
    auto plan = test::plan_of(l, {6, 1, 1, 0, 4, 2, 0, 2}, PlannerKind::kBalanced);
    // Rank 1's tokens: e0 x4, e1 x2, e3 x2.
    const std::vector<int32_t> ids = {0, 1, 0, 3, 0, 1, 0, 3};
    for (const int rank : {-1, 2, 7}) {
        EXPECT_EQ(test::error_of([&] { planner::route_entries(l, plan->view, rank, ids.data(), 4, 4); }),
                  "plan: rank must be in [0, 2), got " + std::to_string(rank));
    }
    // The inputs are checked first: a null topk_idx is named even with a bad rank.
    EXPECT_EQ(test::error_of([&] { planner::route_entries(l, plan->view, 5, nullptr, 4, 4); }),
              "plan: topk_idx is null");
    EXPECT_EQ(planner::route_entries(l, plan->view, 1, ids.data(), 4, 4), -1);  // every id in range
    // Rank 1 keeps its e0 entries (alloc[1][0] = 5 >= 4) and its e3 entries (alloc[1][3] = 2) and sends both e1
    // entries to rank 0 (alloc[1][1] = 0).
    EXPECT_EQ(std::vector<int32_t>(plan->view.entry_rank, plan->view.entry_rank + 8),
              (std::vector<int32_t>{1, 0, 1, 1, 1, 0, 1, 1}));
}

}  // namespace
}  // namespace flatep
