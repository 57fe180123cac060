// check_plan on static plans whose slot table is not a valid placement (no placement given to compare with): each
// of check_placement's refusals comes back prefixed "static slots: ", with its exact text. The plans are the golden
// training plan of test_planner_static.cpp, corrupted by hand.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "planner/static_placement.hpp"
#include "planner_test_util.hpp"

namespace flatep {
namespace {

using Ints = std::vector<int32_t>;

// R=2, E=4 (epn 2, B 2), S=4, K=1; placement [2, -1 | -1, 0], counts [1,1,2,0 | 2,0,1,1].
TEST(CheckPlanStatic, SlotTableThatIsNoPlacement) {
    const Layout l = test::layout_of(2, 4, 4, 1, 1, -1, 0, PlannerKind::kStatic);
    const Ints placement = {2, -1, -1, 0};
    const Ints table = planner::make_placement_table(l, placement);
    planner::HostPlan plan(l);
    const Ints counts = {1, 1, 2, 0, 2, 0, 1, 1};
    std::copy(counts.begin(), counts.end(), plan.view.tpe_all);
    planner::plan_counts(l, PlannerKind::kStatic, plan.view, table.data());
    PlanView& p = plan.view;
    ASSERT_EQ(planner::check_plan(l, p), "");
    ASSERT_EQ(planner::check_plan(l, p, placement.data()), "");
    struct Case {
        int slot;
        int32_t expert;
        const char* want;
    };
    const Case cases[] = {
        {0, 0, "static slots: placement[0][0] = 0 is rank 0's own expert; a slot holds another rank's expert"},
        {3, 9, "static slots: placement[1][1] = 9 is not an expert id in [0, E=4) or -1 (empty)"},
        {3, -2, "static slots: placement[1][1] = -2 is not an expert id in [0, E=4) or -1 (empty)"},
        {2, 0, "static slots: placement[1][1] = 0 repeats placement[1][0] (an expert at most once a rank)"},
    };
    for (const Case& c : cases) {
        const int32_t was = p.slot_expert[c.slot];
        p.slot_expert[c.slot] = c.expert;
        EXPECT_EQ(planner::check_plan(l, p), c.want) << "slot " << c.slot << " = " << c.expert;
        // Given the placement, the first slot that differs from it is named instead.
        EXPECT_EQ(planner::check_plan(l, p, placement.data()),
                  "slot_expert[" + std::to_string(c.slot / 2) + "][" + std::to_string(c.slot % 2) +
                      "] = " + std::to_string(c.expert) + ", expected the placement's " + std::to_string(was));
        p.slot_expert[c.slot] = was;
        ASSERT_EQ(planner::check_plan(l, p), "");
    }
}

}  // namespace
}  // namespace flatep
