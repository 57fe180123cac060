// Serving layout (B < epn slots, the [R*Q + B] view groups) and the owner planner: golden plans for tiny cases worked
// out by hand, and invariants over many count matrices checked against an oracle written from the layout contract
// (layout/layout.hpp) that calls no planner code.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "planner_test_util.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using test::copy_of;
using test::error_of;
using test::layout_of;
using test::plan_of;

using Ints = std::vector<int32_t>;

// R=2, E=8 (epn=4), S=6, K=1: S*K = 6. Rank 0 routes [2,2,1,1], rank 1 [1,3,1,1] (all to rank 0's experts): T =
// [3,5,2,2], G = [12, 0], targets 6 and 6. Greedy: rank 1 (deficit 6) from rank 0: its largest expert e1 (5) moves
// whole, then e0 (3, the next largest) gives 1: alloc[0] = [2,0,2,2 | 0..], alloc[1] = [1,5,0,0 | 0..]. Rank 1 hosts
// two replicas, e1 (5 rows) ahead of e0 (1 row).
const Ints kCounts = {2, 2, 1, 1, 0, 0, 0, 0, 1, 3, 1, 1, 0, 0, 0, 0};
const Ints kAlloc = {2, 0, 2, 2, 0, 0, 0, 0, 1, 5, 0, 0, 0, 0, 0, 0};

// B = 1, Q = 5 (a pad row after each rank's four experts), align 4: G = 2*5 + 1 = 11 groups.
// Rank 0: view rows 0-3 its own e0..e3 (2, 0, 2, 2 rows -> 4, 0, 4, 4), row 4 pad, rows 5-8 rank 1's experts (none
// here), row 9 pad, slot 0 unused. Rank 1: e1 (5 rows) takes the slot (group 10: rows 4..12); e0 (1 row) keeps its
// view row 0 (rows 0..4, weights read from rank 0); own e4..e7 (view rows 5-8) empty, starting at row 4.
TEST(PlannerServing, OneSlotViewStrideWithPadRows) {
    const Layout l = layout_of(2, 8, 6, 1, /*align=*/4, /*num_slots=*/1, /*view_stride=*/5);
    ASSERT_TRUE(l.serving);
    ASSERT_EQ(l.num_groups(), 11);
    ASSERT_EQ(l.num_recv_rows, 32);  // round_up(6 + 2*4*3, 4): the bound does not depend on B
    ASSERT_EQ(l.expert_view_row(6), 7);
    auto plan = plan_of(l, kCounts, PlannerKind::kGreedy);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p), "");
    EXPECT_EQ(copy_of(p.alloc, 16), kAlloc);
    EXPECT_EQ(copy_of(p.slot_expert, 8), (Ints{-1, -1, -1, -1, 1, -1, -1, -1}));
    EXPECT_EQ(copy_of(p.cu_seqlens, 22), (Ints{4, 4, 8, 12, 12, 12, 12, 12, 12, 12, 12,     // rank 0
                                               4, 4, 4, 4,  4,  4,  4,  4,  4,  4,  12}));  // rank 1
    EXPECT_EQ(copy_of(p.group_row, 16), (Ints{0, 4, 4, 8, -1, -1, -1, -1, 0, 4, -1, -1, 4, 4, 4, 4}));
    // group_expert: view rows name their weights' expert (hosted or not), pad rows and unused slots -1.
    const Ints rank1_experts = {0, 1, 2, 3, -1, 4, 5, 6, 7, -1, 1};
    for (int g = 0; g < 11; ++g) EXPECT_EQ(group_expert(l, p, 1, g), rank1_experts[size_t(g)]) << "group " << g;
    EXPECT_EQ(group_expert(l, p, 0, 10), -1);
    // group_entries: the slotted e1's view row 1 is empty on rank 1; its rows are in the slot group.
    EXPECT_EQ(group_entries(l, p, 1, 0), 1);
    EXPECT_EQ(group_entries(l, p, 1, 1), 0);
    EXPECT_EQ(group_entries(l, p, 1, 10), 5);
    // Placement: rank 1's own entry of e0 is kept on rank 1 (view row 0's group, row 0); its three entries of e1 are
    // rows 2..4 of the slot group (rank 0's two come first: sources in ascending rank).
    EXPECT_EQ(place_entry(l, p, 1, 0, 0).rank, 1);
    EXPECT_EQ(place_entry(l, p, 1, 0, 0).row, 0);
    EXPECT_EQ(place_entry(l, p, 0, 1, 1).rank, 1);
    EXPECT_EQ(place_entry(l, p, 0, 1, 1).row, 5);
    EXPECT_EQ(place_entry(l, p, 1, 1, 2).row, 8);
    // Statistics count every replica, slotted or not.
    EXPECT_EQ(p.stats->total_replicas, 2);
    EXPECT_EQ(p.stats->replicas_in[1], 2);
    EXPECT_EQ(p.stats->makespan, 2);
}

// B = 0 (no slots: every replica read in place), Q = epn, align 1: G = 8. Rank 1: e0 in view row 0 (rows 0..1), e1 in
// view row 1 (1..6), own experts empty at 6.
TEST(PlannerServing, NoSlots) {
    const Layout l = layout_of(2, 8, 6, 1, /*align=*/1, /*num_slots=*/0);
    ASSERT_EQ(l.num_groups(), 8);
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced}) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, kCounts, kind);
        const PlanView& p = plan->view;
        EXPECT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 16), kAlloc);
        EXPECT_EQ(copy_of(p.slot_expert, 8), Ints(8, -1));
        EXPECT_EQ(copy_of(p.cu_seqlens, 16), (Ints{2, 2, 4, 6, 6, 6, 6, 6, 1, 6, 6, 6, 6, 6, 6, 6}));
        EXPECT_EQ(copy_of(p.group_row, 16), (Ints{0, 2, 2, 4, -1, -1, -1, -1, 0, 1, -1, -1, 6, 6, 6, 6}));
    }
}

// B = 3 = epn - 1: both replicas of rank 1 get a slot (e0 slot 0, e1 slot 1); G = 2*4 + 3 = 11. Rank 1's own experts
// are its view rows 4..7 (before the slots, unlike the training layout), empty at row 0; slot groups 8, 9, 10.
TEST(PlannerServing, EveryReplicaSlotted) {
    const Layout l = layout_of(2, 8, 6, 1, /*align=*/1, /*num_slots=*/3);
    auto plan = plan_of(l, kCounts, PlannerKind::kBalanced);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p), "");
    EXPECT_EQ(copy_of(p.alloc, 16), kAlloc);
    EXPECT_EQ(copy_of(p.slot_expert, 8), (Ints{-1, -1, -1, -1, 0, 1, -1, -1}));
    EXPECT_EQ(copy_of(p.cu_seqlens, 22), (Ints{2, 2, 4, 6, 6, 6, 6, 6, 6, 6, 6, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 6}));
    EXPECT_EQ(copy_of(p.group_row, 16), (Ints{0, 2, 2, 4, -1, -1, -1, -1, 0, 1, -1, -1, 0, 0, 0, 0}));
    // The training layout of the same counts (B = epn): own groups first, then the slots; today's bits.
    const Layout t = layout_of(2, 8, 6, 1, 1, -1);
    ASSERT_FALSE(t.serving);
    auto trained = plan_of(t, kCounts, PlannerKind::kBalanced);
    EXPECT_EQ(copy_of(trained->view.cu_seqlens, 16), (Ints{2, 2, 4, 6, 6, 6, 6, 6, 0, 0, 0, 0, 1, 6, 6, 6}));
    EXPECT_EQ(copy_of(trained->view.slot_expert, 8), (Ints{-1, -1, -1, -1, 0, 1, -1, -1}));
}

// Equal rows: R=2, E=8, S=6, K=1, rank 0 routes [2,1,2,1], rank 1 [1,2,1,2]: T = [3,3,3,3], G = [12, 0]. Greedy:
// rank 1 takes e0 (3, the lowest of the equal largest) and e1 (3). B = 1: the tie goes to the lower id, e0.
TEST(PlannerServing, EqualRowsSlotTheLowerId) {
    const Layout l = layout_of(2, 8, 6, 1, 1, /*num_slots=*/1);
    const Ints counts = {2, 1, 2, 1, 0, 0, 0, 0, 1, 2, 1, 2, 0, 0, 0, 0};
    auto plan = plan_of(l, counts, PlannerKind::kGreedy);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p), "");
    EXPECT_EQ(copy_of(p.alloc, 16), (Ints{0, 0, 3, 3, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0}));
    EXPECT_EQ(copy_of(p.slot_expert, 8), (Ints{-1, -1, -1, -1, 0, -1, -1, -1}));
    // Rank 1: e1 in view row 1 (rows 0..3), own experts empty at 3, slot e0 (rows 3..6).
    EXPECT_EQ(copy_of(p.cu_seqlens + 9, 9), (Ints{0, 3, 3, 3, 3, 3, 3, 3, 6}));
    EXPECT_EQ(copy_of(p.group_row + 8, 8), (Ints{3, 0, -1, -1, 3, 3, 3, 3}));
}

// The owner planner: the home allocation, no slots. C = R*S*K = 12, NvS = round_up(12 + epn*(align-1), align) =
// round_up(12 + 4*3, 4) = 24. Training group layout (B = epn) and the serving one (B = 1, one view over the same
// weights): rank 0 holds every entry in its own groups, rank 1 none.
TEST(PlannerServing, OwnerPlanner) {
    const Layout l = layout_of(2, 8, 6, 1, /*align=*/4, -1, 0, PlannerKind::kOwner);
    ASSERT_TRUE(l.owner);
    ASSERT_FALSE(l.exact);
    ASSERT_EQ(l.capacity, 12);
    ASSERT_EQ(l.num_recv_rows, 24);
    const Ints home = {3, 5, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    auto plan = plan_of(l, kCounts, PlannerKind::kOwner);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p), "");
    EXPECT_EQ(copy_of(p.alloc, 16), home);
    EXPECT_EQ(copy_of(p.slot_expert, 8), Ints(8, -1));
    EXPECT_EQ(copy_of(p.cu_seqlens, 16), (Ints{4, 12, 16, 20, 20, 20, 20, 20, 0, 0, 0, 0, 0, 0, 0, 0}));
    EXPECT_EQ(copy_of(p.group_row, 16), (Ints{0, 4, 12, 16, -1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0}));
    const PlanStats& st = *p.stats;
    EXPECT_EQ(st.total_replicas, 0);
    EXPECT_EQ(st.makespan, 0);
    EXPECT_EQ(st.max_load_after, 12);
    EXPECT_EQ(st.loads_after[0], st.loads_before[0]);
    EXPECT_EQ(st.entries_moved, 6);  // rank 1's six entries all go to rank 0
    // Rank 1's entry 2 of e1 (its third) goes to rank 0 after rank 0's two: row 4 + 2 + 2.
    EXPECT_EQ(place_entry(l, p, 1, 1, 2).rank, 0);
    EXPECT_EQ(place_entry(l, p, 1, 1, 2).row, 8);

    const Layout v = layout_of(2, 8, 6, 1, 4, /*num_slots=*/1, 0, PlannerKind::kOwner);
    auto served = plan_of(v, kCounts, PlannerKind::kOwner);
    EXPECT_EQ(planner::check_plan(v, served->view), "");
    EXPECT_EQ(copy_of(served->view.alloc, 16), home);
    EXPECT_EQ(copy_of(served->view.cu_seqlens, 18),
              (Ints{4, 12, 16, 20, 20, 20, 20, 20, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0}));

    // The planner kind and the layout must agree.
    EXPECT_NE(error_of([&] { plan_of(l, kCounts, PlannerKind::kBalanced); }).find("owner"), std::string::npos);
    const Layout balanced = layout_of(2, 8, 6, 1, 4, -1);
    EXPECT_NE(error_of([&] { plan_of(balanced, kCounts, PlannerKind::kOwner); }).find("owner"), std::string::npos);
}

TEST(PlannerServing, PlannerNames) {
    for (PlannerKind kind : {PlannerKind::kGreedy, PlannerKind::kBalanced, PlannerKind::kOwner, PlannerKind::kStatic})
        EXPECT_EQ(planner_from_name(planner_name(kind)), kind);
    EXPECT_STREQ(planner_name(PlannerKind::kOwner), "owner");
    EXPECT_STREQ(planner_name(PlannerKind::kStatic), "static");
    EXPECT_EQ(error_of([] { planner_from_name("fast"); }),
              "planner must be 'greedy', 'balanced', 'owner' or 'static', got 'fast'");
}

// ---- Invariants ----

// The serving layout's oracle, from layout.hpp's contract alone, for rank d of a plan with allocation `alloc`: which
// expert's rows each group holds (-1: none) and the slot list.
struct ServingGroups {
    Ints slots;    // [epn] the B replicas with the most rows (ties: lower id), ascending, then -1
    Ints holds;    // [G] expert whose rows the group holds, -1 when none
    Ints weights;  // [G] expert whose weights the group reads (view row's expert, slot's expert), -1 pad / unused
};

ServingGroups serving_groups(const Layout& l, const int32_t* alloc, int d) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank, B = l.num_slots, Q = l.view_stride;
    std::vector<std::pair<int32_t, int>> replicas;  // (-rows, id): sorted = the slot order
    for (int e = 0; e < E; ++e)
        if (e / epn != d && alloc[int64_t(d) * E + e] > 0) replicas.push_back({-alloc[int64_t(d) * E + e], e});
    std::sort(replicas.begin(), replicas.end());
    Ints chosen;
    for (size_t i = 0; i < replicas.size() && int(i) < B; ++i) chosen.push_back(replicas[i].second);
    std::sort(chosen.begin(), chosen.end());
    ServingGroups s;
    s.slots = chosen;
    s.slots.resize(size_t(epn), -1);
    for (int h = 0; h < R; ++h) {
        for (int i = 0; i < Q; ++i) {
            const int e = i < epn ? h * epn + i : -1;
            const bool slotted = std::find(chosen.begin(), chosen.end(), e) != chosen.end();
            const bool held = e >= 0 && (h == d || (alloc[int64_t(d) * E + e] > 0 && !slotted));
            s.weights.push_back(e);
            s.holds.push_back(held ? e : -1);
        }
    }
    for (int j = 0; j < B; ++j) {
        s.weights.push_back(s.slots[size_t(j)]);
        s.holds.push_back(s.slots[size_t(j)]);
    }
    return s;
}

// Checks a serving plan against the oracle and the training plan of the same counts (same allocation, same split).
void check_serving(const Layout& l, const PlanView& p, const PlanView& trained, const std::string& what) {
    const int R = l.num_ranks, E = l.num_experts, epn = l.experts_per_rank, G = l.num_groups();
    ASSERT_EQ(planner::check_plan(l, p), "") << what;
    const int64_t re = int64_t(R) * E;
    ASSERT_EQ(copy_of(p.alloc, re), copy_of(trained.alloc, re)) << "the allocation depends on B: " << what;
    ASSERT_EQ(copy_of(p.keep, re), copy_of(trained.keep, re)) << what;
    ASSERT_EQ(copy_of(p.take_start, re), copy_of(trained.take_start, re)) << what;
    for (int d = 0; d < R; ++d) {
        const ServingGroups s = serving_groups(l, p.alloc, d);
        const int32_t* cu = p.cu_seqlens + int64_t(d) * G;
        int used = 0;
        for (int j = 0; j < epn; ++j) used += p.slot_expert[d * epn + j] >= 0;
        ASSERT_LE(used, l.num_slots) << "rank " << d << ": " << what;
        ASSERT_EQ(copy_of(p.slot_expert + d * epn, epn), s.slots) << "rank " << d << ": " << what;
        int32_t prev = 0;
        for (int g = 0; g < G; ++g) {
            ASSERT_GE(cu[g], prev) << "rank " << d << " group " << g << ": " << what;
            const int e = s.holds[size_t(g)];
            const int32_t rows = e >= 0 ? p.alloc[int64_t(d) * E + e] : 0;
            ASSERT_EQ(cu[g] - prev, (rows + l.align - 1) / l.align * l.align)
                << "rank " << d << " group " << g << ": " << what;
            ASSERT_EQ(group_expert(l, p, d, g), s.weights[size_t(g)]) << "rank " << d << " group " << g;
            ASSERT_EQ(group_entries(l, p, d, g), rows) << "rank " << d << " group " << g;
            if (e >= 0) ASSERT_EQ(p.group_row[int64_t(d) * E + e], prev) << "rank " << d << " group " << g;
            prev = cu[g];
        }
        // Every replica of d without a slot sits in its view row's group.
        for (int e = 0; e < E; ++e) {
            if (e / epn == d || p.alloc[int64_t(d) * E + e] == 0) continue;
            if (std::find(s.slots.begin(), s.slots.end(), e) != s.slots.end()) continue;
            const int g = l.expert_view_row(e);
            ASSERT_EQ(p.group_row[int64_t(d) * E + e], g == 0 ? 0 : cu[g - 1]) << "rank " << d << " expert " << e;
        }
    }
}

TEST(PlannerServing, InvariantsOverRandomMatrices) {
    uint64_t state = 4242;
    auto below = [&](int n) { return int(routing::mix64(state++) % uint64_t(n)); };
    int cases = 0, overflowing = 0;
    for (int it = 0; it < 1500; ++it) {
        const int R = 1 + below(8), epn = 1 + below(6), E = R * epn;
        const int K = 1 + below(std::min(E, 4)), S = 1 + below(40);
        const bool partial = below(4) == 0;
        const int hot = below(E);
        Ints counts(size_t(R) * E, 0);
        for (int s = 0; s < R; ++s) {
            const int entries = partial ? below(S * K + 1) : S * K;
            const int mode = below(3);
            for (int i = 0; i < entries; ++i) {
                int e = below(E);
                if (mode == 1 && below(2) == 0) e = hot;
                if (mode == 2) e = (e % epn) + epn * (below(3) == 0 ? s : 0);
                ++counts[size_t(s) * E + e];
            }
        }
        static const int kAligns[] = {1, 4, 128};
        const int align = kAligns[below(3)];
        const double factor = 1.0 + 0.25 * below(3);
        const PlannerKind kind = below(2) == 0 ? PlannerKind::kGreedy : PlannerKind::kBalanced;
        const Layout t = layout_of(R, E, S, K, align, -1, 0, kind, factor);
        auto trained = plan_of(t, counts, kind);
        for (int B : {0, 1, epn - 1, 4}) {
            if (B >= epn) continue;
            for (int Q : {epn, epn + below(3)}) {
                const Layout l = layout_of(R, E, S, K, align, B, Q, kind, factor);
                const std::string what = "it=" + std::to_string(it) + " R=" + std::to_string(R) +
                                         " E=" + std::to_string(E) + " B=" + std::to_string(B) +
                                         " Q=" + std::to_string(Q) + " " + planner_name(kind);
                auto plan = plan_of(l, counts, kind);
                check_serving(l, plan->view, trained->view, what);
                if (HasFatalFailure()) return;
                for (int d = 0; d < R; ++d) overflowing += plan->view.stats->replicas_in[d] > B;
                ++cases;
            }
        }
        // The owner planner: the home allocation; loads after = the group loads.
        const Layout o = layout_of(R, E, S, K, align, below(2) == 0 ? -1 : below(epn + 1), 0, PlannerKind::kOwner);
        auto owned = plan_of(o, counts, PlannerKind::kOwner);
        ASSERT_EQ(planner::check_plan(o, owned->view), "") << "owner it=" << it;
        for (int d = 0; d < R; ++d) {
            ASSERT_EQ(owned->view.stats->loads_after[d], owned->view.stats->loads_before[d]) << "owner it=" << it;
            for (int e = 0; e < E; ++e) {
                int32_t t_e = 0;
                for (int s = 0; s < R; ++s) t_e += counts[size_t(s) * E + e];
                ASSERT_EQ(owned->view.alloc[int64_t(d) * E + e], e / epn == d ? t_e : 0) << "owner it=" << it;
            }
        }
        ASSERT_EQ(owned->view.stats->total_replicas, 0);
    }
    EXPECT_GT(cases, 3000);
    EXPECT_GT(overflowing, 100);  // ranks with more replicas than slots: the view-row path is exercised
}

// check_plan catches serving plans that break the slot rule or the view layout.
TEST(PlannerServing, CheckPlanDetectsCorruption) {
    const Layout l = layout_of(2, 8, 6, 1, 1, /*num_slots=*/1);
    auto plan = plan_of(l, kCounts, PlannerKind::kGreedy);
    const PlanView& p = plan->view;
    ASSERT_EQ(planner::check_plan(l, p), "");
    const int G = l.num_groups();
    // The slot given to the replica with fewer rows (e0 instead of e1).
    p.slot_expert[4] = 0;
    EXPECT_NE(planner::check_plan(l, p).find("slot_expert[1][0] = 0, expected 1"), std::string::npos)
        << planner::check_plan(l, p);
    p.slot_expert[4] = 1;
    // Rows put into rank 1's view row of e2 (not hosted there).
    for (int g = 2; g < G; ++g) ++p.cu_seqlens[G + g];
    EXPECT_NE(planner::check_plan(l, p).find("cu_seqlens[1][2]"), std::string::npos) << planner::check_plan(l, p);
    for (int g = 2; g < G; ++g) --p.cu_seqlens[G + g];
    // e0's rows on rank 1 pointed at the slot group instead of its view row.
    p.group_row[8] = 6;
    EXPECT_NE(planner::check_plan(l, p).find("group_row[1][0]"), std::string::npos) << planner::check_plan(l, p);
}

}  // namespace
}  // namespace flatep
