// Golden plans for tiny cases, worked out by hand (the derivations are in the comments).
#include <gtest/gtest.h>

#include <vector>

#include "planner_test_util.hpp"

namespace flatep {
namespace {

using test::copy_of;
using test::make_test_layout;
using test::plan_of;

// R=2, E=4 (epn=2), S=4, K=2: S*K = 8. tpe rows: [6,1,1,0] and [4,2,0,2]: T = [10,3,1,2], G = [13,3], N = 16,
// targets 8 and 8. Greedy: rank 1 (deficit 5) is filled from rank 0's largest expert 0: alloc[1][0] = 5.
// Every balanced candidate ends at the same allocation (one replica, P = 1).
// Split: keep = min(tpe, alloc); a source that does not host e spills all of it (source 0 -> e2, source 1 -> e1),
// so spill_start[1][0] = 1, spill_start[1][2] = 1, and rank 1's take range of e1 starts after rank 0's (3 - 1 = 2).
TEST(PlannerGolden, ExactTwoRanksOneReplica) {
    const Layout l = make_test_layout(2, 4, 4, 2, /*align=*/1);
    const std::vector<int32_t> counts = {6, 1, 1, 0, 4, 2, 0, 2};
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        EXPECT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 8), (std::vector<int32_t>{5, 3, 0, 0, 5, 0, 1, 2}));
        EXPECT_EQ(copy_of(p.keep, 8), (std::vector<int32_t>{5, 1, 0, 0, 4, 0, 0, 2}));
        EXPECT_EQ(copy_of(p.spill_start, 8), (std::vector<int32_t>{0, 0, 0, 0, 1, 0, 1, 0}));
        EXPECT_EQ(copy_of(p.take_start, 8), (std::vector<int32_t>{0, 0, 0, 0, 0, 2, 0, 0}));
        EXPECT_EQ(copy_of(p.slot_expert, 4), (std::vector<int32_t>{-1, -1, 0, -1}));
        // Rank 0: e0 (5) e1 (3) | no slots. Rank 1: e2 (1) e3 (2) | slot 0 = e0 (5).
        EXPECT_EQ(copy_of(p.cu_seqlens, 8), (std::vector<int32_t>{5, 8, 8, 8, 1, 3, 8, 8}));
        EXPECT_EQ(copy_of(p.group_row, 8), (std::vector<int32_t>{0, 5, -1, -1, 3, -1, 0, 1}));
        const PlanStats& st = *p.stats;
        EXPECT_EQ(st.entries_total, 16);
        EXPECT_EQ(st.entries_on_source, 12);
        EXPECT_EQ(st.entries_moved, 4);
        EXPECT_EQ(st.max_load_before, 13);
        EXPECT_EQ(st.max_load_after, 8);
        EXPECT_EQ(st.min_load_after, 8);
        EXPECT_EQ(st.total_replicas, 1);
        EXPECT_EQ(st.makespan, 1);
        EXPECT_EQ(st.replicas_in[1], 1);
        EXPECT_EQ(st.replicas_out[0], 1);
        EXPECT_EQ(st.loads_before[0], 13);
        EXPECT_EQ(st.loads_before[1], 3);
        // Source 0's sixth entry for e0 (j=5) is its only spilled one: it lands on rank 1, first row of the slot
        // group (sources before rank 1 come first); rank 1's own four entries follow.
        EXPECT_EQ(place_entry(l, p, 0, 0, 4).rank, 0);
        EXPECT_EQ(place_entry(l, p, 0, 0, 4).row, 4);
        EXPECT_EQ(place_entry(l, p, 0, 0, 5).rank, 1);
        EXPECT_EQ(place_entry(l, p, 0, 0, 5).row, 3);
        EXPECT_EQ(place_entry(l, p, 1, 0, 0).row, 4);
        EXPECT_EQ(place_entry(l, p, 1, 0, 3).row, 7);
    }
}

// Same counts, slack mode capacity_factor 1.5: C = 12, align 4, NvS = round_up(12 + 2*2*3, 4) = 24.
// Only rank 0 is above C (13): one entry of its largest expert e0 moves to rank 1 (greedy target of rank 1 = 4).
// Rank 0: e0 9 -> 12 rows, e1 3 -> 4 rows. Rank 1: e2 1 -> 4, e3 2 -> 4, slot e0 1 -> 4.
// Split: keep[0][0] = 6, keep[1][0] = min(4, 1) = 1; source 1 spills 3 entries of e0, all taken by rank 0.
TEST(PlannerGolden, SlackModeAndRoutingRows) {
    const Layout l = make_test_layout(2, 4, 4, 2, /*align=*/4, /*capacity_factor=*/1.5);
    ASSERT_EQ(l.capacity, 12);
    ASSERT_EQ(l.num_recv_rows, 24);
    const std::vector<int32_t> counts = {6, 1, 1, 0, 4, 2, 0, 2};
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        EXPECT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 8), (std::vector<int32_t>{9, 3, 0, 0, 1, 0, 1, 2}));
        EXPECT_EQ(copy_of(p.slot_expert, 4), (std::vector<int32_t>{-1, -1, 0, -1}));
        EXPECT_EQ(copy_of(p.cu_seqlens, 8), (std::vector<int32_t>{12, 16, 16, 16, 4, 8, 12, 12}));
        EXPECT_EQ(copy_of(p.group_row, 8), (std::vector<int32_t>{0, 12, -1, -1, 8, -1, 0, 4}));
        EXPECT_EQ(p.stats->max_load_after, 12);
        EXPECT_EQ(p.stats->min_load_after, 4);
        EXPECT_EQ(p.stats->entries_on_source, 6 + 1 + 1 + 2);  // keep[0][0], keep[0][1], keep[1][0], keep[1][3]

        // Rank 1 routes tokens [0,1] [0,3] [0,1] [0,3] (its row of counts: e0 x4, e1 x2, e3 x2).
        //   e0 j=0 kept on rank 1, row 8 (slot group start); j=1..3 spill to rank 0 after its 6 kept rows: 6, 7, 8.
        //   e1: rank 0 keeps its 1 entry (row 12); rank 1's two spill after it: rows 13, 14.
        //   e3: home rank 1 keeps both: rows 4, 5.
        const std::vector<int32_t> topk = {0, 1, 0, 3, 0, 1, 0, 3};
        EXPECT_EQ(planner::route_entries(l, p, 1, topk.data(), 4, 4), -1);
        EXPECT_EQ(copy_of(p.entry_rank, 8), (std::vector<int32_t>{1, 0, 0, 1, 0, 0, 0, 1}));
        EXPECT_EQ(copy_of(p.entry_row, 8), (std::vector<int32_t>{8, 13, 6, 4, 7, 14, 8, 5}));
        // Same with int64 ids and two invalid ones: they get -1 and are skipped (the counter j does not advance).
        const std::vector<int64_t> topk64 = {0, 1, 7, 0, 3, 0, -1, 1, 0, 3};
        EXPECT_EQ(planner::route_entries(l, p, 1, topk64.data(), 8, 4), 2);
        EXPECT_EQ(copy_of(p.entry_rank, 8), (std::vector<int32_t>{1, 0, -1, 0, 1, 0, -1, 0}));
        EXPECT_EQ(copy_of(p.entry_row, 8), (std::vector<int32_t>{8, 13, -1, 6, 4, 7, -1, 14}));
    }
}

// A cascade: R=3, E=3 (epn=1), S=2, K=1. tpe rows [2,0,0], [0,2,0], [1,1,0]: T = [3,3,0], G = [3,3,0], targets 2.
// Greedy: rank 2 (deficit 2) is filled from rank 0 (surplus 1, tie with rank 1 -> lower rank), which then lacks 1
// and is filled from rank 1: alloc = [[1,1,0],[0,2,0],[2,0,0]], P = 1, 2 replicas, 2 entries moved.
// The balanced planner's candidates tie with it at best (P=1 needs a chain; transports need 2 slots on rank 2), so
// the greedy plan is kept.
TEST(PlannerGolden, GreedyCascadeWithOneSlotPerRank) {
    const Layout l = make_test_layout(3, 3, 2, 1);
    const std::vector<int32_t> counts = {2, 0, 0, 0, 2, 0, 1, 1, 0};
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        EXPECT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 9), (std::vector<int32_t>{1, 1, 0, 0, 2, 0, 2, 0, 0}));
        EXPECT_EQ(copy_of(p.slot_expert, 3), (std::vector<int32_t>{1, -1, 0}));
        EXPECT_EQ(copy_of(p.cu_seqlens, 6), (std::vector<int32_t>{1, 2, 2, 2, 0, 2}));
        EXPECT_EQ(copy_of(p.group_row, 9), (std::vector<int32_t>{0, 1, -1, -1, 0, -1, 0, -1, 0}));
        EXPECT_EQ(p.stats->makespan, 1);
        EXPECT_EQ(p.stats->total_replicas, 2);
        EXPECT_EQ(p.stats->entries_moved, 2);
    }
}

// Partial batch, exact mode: N = 5 over R = 2 -> targets 3 and 2 (the lower rank takes the remainder).
// tpe rows [0,0,3,0] (sum 3 < S*K = 4) and [0,0,1,1]: T = [0,0,4,1], G = [0,5]. Rank 0 takes 3 entries of e2.
TEST(PlannerGolden, PartialBatchLowerRankTakesRemainder) {
    const Layout l = make_test_layout(2, 4, 2, 2);
    const std::vector<int32_t> counts = {0, 0, 3, 0, 0, 0, 1, 1};
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        EXPECT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 8), (std::vector<int32_t>{0, 0, 3, 0, 0, 0, 1, 1}));
        EXPECT_EQ(copy_of(p.slot_expert, 4), (std::vector<int32_t>{2, -1, -1, -1}));
        // Rank 0: empty home groups e0, e1, then slot e2 (3). Rank 1: e2 (1), e3 (1).
        EXPECT_EQ(copy_of(p.cu_seqlens, 8), (std::vector<int32_t>{0, 0, 3, 3, 1, 2, 2, 2}));
        EXPECT_EQ(copy_of(p.group_row, 8), (std::vector<int32_t>{0, 0, 0, -1, -1, -1, 0, 1}));
        EXPECT_EQ(p.stats->entries_moved, 0);  // every entry stays on its source
        EXPECT_EQ(p.stats->loads_after[0], 3);
        EXPECT_EQ(p.stats->loads_after[1], 2);
    }
}

TEST(PlannerGolden, PlannerNames) {
    EXPECT_STREQ(planner_name(PlannerKind::kGreedy), "greedy");
    EXPECT_STREQ(planner_name(PlannerKind::kBalanced), "balanced");
}

}  // namespace
}  // namespace flatep
