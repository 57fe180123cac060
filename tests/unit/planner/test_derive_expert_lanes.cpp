// derive_experts (planner/derive.hpp, task R + chunk) on a lane group wider than the experts: the lanes past E hold no
// expert (valid false) and must neither write a cell nor add to a sum, with a placement table (the static planner's
// copies) and without (a replica is a rank with rows). Each lane is a host thread; the primitives derive_experts uses
// are exchanges between two barriers. The results must equal the one-lane derivation's and the planner's own plan.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "planner/derive.hpp"
#include "planner/static_placement.hpp"
#include "planner_test_util.hpp"
#include "unit/planner/thread_lanes.hpp"

namespace flatep {
namespace {

using Ints = std::vector<int32_t>;

struct Derived {
    Ints keep, spill_start, take_start;
    planner::DeriveSums sums{};
};

// derive_experts of every chunk of the plan's alloc on W lanes (W = 1: the host's OneLane), into fresh arrays.
template <int W>
Derived derive_on_lanes(const Layout& l, const planner::HostPlan& planned, planner::PlacementView placed) {
    const int RE = l.num_ranks * l.num_experts;
    planner::HostPlan fresh(l);
    std::fill(fresh.view.keep, fresh.view.keep + RE, -7);  // a lane past E must leave every cell alone
    std::fill(fresh.view.spill_start, fresh.view.spill_start + RE, -7);
    std::fill(fresh.view.take_start, fresh.view.take_start + RE, -7);
    Derived out;
    const int chunks = (l.num_experts + W - 1) / W;
    if constexpr (W == 1) {
        for (int c = 0; c < chunks; ++c)
            planner::derive_experts(planner::OneLane{}, l, fresh.view, planned.view.tpe_all, planned.view.alloc, c,
                                    out.sums, placed);
    } else {
        testing::LaneShared<W> shared;
        std::vector<std::thread> threads;
        for (int lane = 0; lane < W; ++lane) {
            threads.emplace_back([&, lane] {
                const testing::ThreadLanes<W, 1> g{lane, &shared};
                for (int c = 0; c < chunks; ++c)
                    planner::derive_experts(g, l, fresh.view, planned.view.tpe_all, planned.view.alloc, c, out.sums,
                                            placed);
            });
        }
        for (std::thread& t : threads) t.join();
    }
    out.keep.assign(fresh.view.keep, fresh.view.keep + RE);
    out.spill_start.assign(fresh.view.spill_start, fresh.view.spill_start + RE);
    out.take_start.assign(fresh.view.take_start, fresh.view.take_start + RE);
    return out;
}

void expect_as_planned(const Layout& l, const Derived& got, const planner::HostPlan& planned, const char* what) {
    const PlanView& p = planned.view;
    const int RE = l.num_ranks * l.num_experts;
    EXPECT_EQ(got.keep, Ints(p.keep, p.keep + RE)) << what;
    EXPECT_EQ(got.spill_start, Ints(p.spill_start, p.spill_start + RE)) << what;
    EXPECT_EQ(got.take_start, Ints(p.take_start, p.take_start + RE)) << what;
    EXPECT_EQ(int64_t(got.sums.entries_total), p.stats->entries_total) << what;
    EXPECT_EQ(int64_t(got.sums.entries_on_source), p.stats->entries_on_source) << what;
    for (int d = 0; d < l.num_ranks; ++d) {
        EXPECT_EQ(got.sums.loads_before[d], p.stats->loads_before[d]) << what << " rank " << d;
        EXPECT_EQ(got.sums.replicas_out[d], p.stats->replicas_out[d]) << what << " rank " << d;
    }
    for (int d = l.num_ranks; d < kMaxRanks; ++d) {  // lanes past E (home rank -1) add to no rank
        EXPECT_EQ(got.sums.loads_before[d], 0) << what;
        EXPECT_EQ(got.sums.replicas_out[d], 0) << what;
    }
}

// The static planner's golden training plan (test_planner_static.cpp, GoldenTrainingLayout): R=2, E=4, placement
// [2, -1 | -1, 0], counts [1,1,2,0 | 2,0,1,1]: loads before [4, 4], one placed copy out of each rank, 7 of 8 kept.
TEST(DeriveExpertLanes, StaticPlacementOnMoreLanesThanExperts) {
    const Layout l = test::layout_of(2, 4, 4, 1, 1, -1, 0, PlannerKind::kStatic);
    const Ints table = planner::make_placement_table(l, Ints{2, -1, -1, 0});
    planner::HostPlan planned(l);
    const Ints counts = {1, 1, 2, 0, 2, 0, 1, 1};
    std::copy(counts.begin(), counts.end(), planned.view.tpe_all);
    planner::plan_counts(l, PlannerKind::kStatic, planned.view, table.data());
    ASSERT_EQ(planner::check_plan(l, planned.view), "");
    const planner::PlacementView placed = planner::make_placement_view(l, table.data());
    for (const Derived& d : {derive_on_lanes<1>(l, planned, placed), derive_on_lanes<8>(l, planned, placed),
                             derive_on_lanes<3>(l, planned, placed)}) {
        expect_as_planned(l, d, planned, "static");
        EXPECT_EQ(d.sums.loads_before[0], 4);
        EXPECT_EQ(d.sums.loads_before[1], 4);
        EXPECT_EQ(d.sums.replicas_out[0], 1);
        EXPECT_EQ(d.sums.replicas_out[1], 1);
        EXPECT_EQ(d.sums.entries_on_source, 7u);
    }
}

// Without a placement: check_plan's golden ExactTwoRanksOneReplica (alloc [5,3,0,0 | 5,0,1,2], one replica of e0 on
// rank 1), on 8 lanes (4 past E) and on 3 (two chunks, the second with two lanes past E).
TEST(DeriveExpertLanes, BalancedPlanOnMoreLanesThanExperts) {
    const Layout l = test::make_test_layout(2, 4, 4, 2);
    auto planned = test::plan_of(l, {6, 1, 1, 0, 4, 2, 0, 2}, PlannerKind::kBalanced);
    ASSERT_EQ(Ints(planned->view.alloc, planned->view.alloc + 8), (Ints{5, 3, 0, 0, 5, 0, 1, 2}));
    for (const Derived& d : {derive_on_lanes<1>(l, *planned, {}), derive_on_lanes<8>(l, *planned, {}),
                             derive_on_lanes<3>(l, *planned, {})}) {
        expect_as_planned(l, d, *planned, "balanced");
        EXPECT_EQ(d.sums.loads_before[0], 13);
        EXPECT_EQ(d.sums.replicas_out[0], 1);
        EXPECT_EQ(d.sums.replicas_out[1], 0);
    }
}

}  // namespace
}  // namespace flatep
