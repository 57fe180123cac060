// The static planner (design §4 "The static planner"): the split rule on hand-made counts, golden plans worked out by
// hand, bad placements, and invariants over many random count matrices and placements, each plan checked by
// check_plan (its independent re-derivation) and by the oracle below, which calls no planner code.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "planner/derive.hpp"
#include "planner/static_placement.hpp"
#include "planner_test_util.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using test::copy_of;
using test::error_of;
using Ints = std::vector<int32_t>;

Layout static_layout(int R, int E, int S, int K, int align, int num_slots, int view_stride = 0) {
    return test::layout_of(R, E, S, K, align, num_slots, view_stride, PlannerKind::kStatic);
}

std::unique_ptr<planner::HostPlan> static_plan(const Layout& l, const Ints& counts, const Ints& placement) {
    const Ints table = planner::make_placement_table(l, placement);
    auto plan = std::make_unique<planner::HostPlan>(l);
    std::copy(counts.begin(), counts.end(), plan->view.tpe_all);
    planner::plan_counts(l, PlannerKind::kStatic, plan->view, table.data());
    return plan;
}

// The rule: floor(T / n) each, one more for the T mod n copies from copy e mod n on, cyclically.
TEST(PlannerStatic, SplitRuleByHand) {
    // T = 7 over 3 copies of expert 4: first = 4 mod 3 = 1, one extra (7 mod 3) for copy 1: 2, 3, 2.
    EXPECT_EQ(planner::static_share(7, 3, 0, 4), 2);
    EXPECT_EQ(planner::static_share(7, 3, 1, 4), 3);
    EXPECT_EQ(planner::static_share(7, 3, 2, 4), 2);
    // T = 8 over 3 copies of expert 5: first = 2, extras for copies 2 and 0 (cyclically): 3, 2, 3.
    EXPECT_EQ(planner::static_share(8, 3, 0, 5), 3);
    EXPECT_EQ(planner::static_share(8, 3, 1, 5), 2);
    EXPECT_EQ(planner::static_share(8, 3, 2, 5), 3);
    // Fewer entries than copies: T = 1 over 2 copies of expert 5 goes to copy 1; of expert 4 to copy 0.
    EXPECT_EQ(planner::static_share(1, 2, 0, 5), 0);
    EXPECT_EQ(planner::static_share(1, 2, 1, 5), 1);
    EXPECT_EQ(planner::static_share(1, 2, 0, 4), 1);
    // One copy takes everything; none of nothing.
    EXPECT_EQ(planner::static_share(9, 1, 0, 3), 9);
    EXPECT_EQ(planner::static_share(0, 4, 2, 3), 0);
}

// R=2, E=4 (epn=2), S=4, K=1, align 1, training layout (B = epn = 2). Rank 0's slots hold [2, -1], rank 1's [-1, 0]
// (an empty slot first: the placement's order is kept). Counts: rank 0 [1,1,2,0], rank 1 [2,0,1,1]; T = [3,1,3,1].
//   e0: copies rank 0 (home), rank 1 (slot 1); 3 over 2 from copy 0: rank 0 gets 2, rank 1 gets 1.
//   e2: copies rank 0 (slot 0), rank 1 (home); 3 over 2 from copy 0 (2 mod 2): rank 0 2, rank 1 1.
//   e1, e3: one copy each.
// Rank 1 keeps one of its two e0 entries and spills the other to rank 0 (rows: rank 0's own first, then rank 1's).
TEST(PlannerStatic, GoldenTrainingLayout) {
    const Layout l = static_layout(2, 4, 4, 1, 1, -1);
    ASSERT_EQ(l.capacity, 8);
    ASSERT_EQ(l.num_recv_rows, 8);
    const Ints placement = {2, -1, -1, 0};
    auto plan = static_plan(l, {1, 1, 2, 0, 2, 0, 1, 1}, placement);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p, placement.data()), "");
    EXPECT_EQ(copy_of(p.alloc, 8), (Ints{2, 1, 2, 0, 1, 0, 1, 1}));
    EXPECT_EQ(copy_of(p.slot_expert, 4), placement);
    EXPECT_EQ(copy_of(p.cu_seqlens, 8), (Ints{2, 3, 5, 5, 1, 2, 2, 3}));
    EXPECT_EQ(copy_of(p.group_row, 8), (Ints{0, 2, 3, -1, 2, -1, 0, 1}));
    EXPECT_EQ(copy_of(p.keep, 8), (Ints{1, 1, 2, 0, 1, 0, 1, 1}));
    EXPECT_EQ(place_entry(l, p, 0, 0, 0).rank, 0);
    EXPECT_EQ(place_entry(l, p, 0, 0, 0).row, 0);
    EXPECT_EQ(place_entry(l, p, 1, 0, 0).rank, 1);  // kept
    EXPECT_EQ(place_entry(l, p, 1, 0, 0).row, 2);   // rank 1's slot 1 group (after its own two)
    EXPECT_EQ(place_entry(l, p, 1, 0, 1).rank, 0);  // spilled to rank 0's copy
    EXPECT_EQ(place_entry(l, p, 1, 0, 1).row, 1);
    const PlanStats& st = *p.stats;
    EXPECT_EQ(st.entries_total, 8);
    EXPECT_EQ(st.entries_on_source, 7);
    EXPECT_EQ(st.loads_before[0], 4);
    EXPECT_EQ(st.loads_before[1], 4);
    EXPECT_EQ(st.loads_after[0], 5);
    EXPECT_EQ(st.loads_after[1], 3);
    EXPECT_EQ(st.total_replicas, 2);
    EXPECT_EQ(st.replicas_in[0], 1);
    EXPECT_EQ(st.replicas_out[1], 1);
    EXPECT_EQ(st.makespan, 1);
}

// Serving: R=2, E=8 (epn=4), S=4, K=1, B=1, Q=epn, align 2: G = 9 groups. Rank 0's slot holds e5 (rank 1's), rank 1's
// slot is empty. Counts: rank 0 routes e0 x2 and e5 x1, rank 1 e4 x3. e5: 1 entry over copies rank 0 (slot), rank 1
// (home), from copy 5 mod 2 = 1: the entry goes to rank 1, and rank 0's slot group stays empty while the slot still
// names e5 (its weights stay placed).
TEST(PlannerStatic, GoldenServingWithAnEmptyPlacedCopy) {
    const Layout l = static_layout(2, 8, 4, 1, 2, 1);
    ASSERT_TRUE(l.serving);
    ASSERT_EQ(l.num_recv_rows, 14);  // round_up(R*S*K + (epn + B)*(align-1), align) = round_up(8 + 5, 2)
    const Ints placement = {5, -1};
    auto plan = static_plan(l, {2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0}, placement);
    const PlanView& p = plan->view;
    EXPECT_EQ(planner::check_plan(l, p, placement.data()), "");
    EXPECT_EQ(copy_of(p.alloc, 16), (Ints{2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 1, 0, 0}));
    EXPECT_EQ(copy_of(p.slot_expert, 8), (Ints{5, -1, -1, -1, -1, -1, -1, -1}));
    EXPECT_EQ(copy_of(p.cu_seqlens, 18), (Ints{2, 2, 2, 2, 2, 2, 2, 2, 2,     // rank 0: e0, then the empty slot e5
                                               0, 0, 0, 0, 4, 6, 6, 6, 6}));  // rank 1: e4 (3 -> 4), e5 (1 -> 2)
    EXPECT_EQ(copy_of(p.group_row, 16), (Ints{0, 2, 2, 2, -1, 2, -1, -1, -1, -1, -1, -1, 0, 4, 6, 6}));
    EXPECT_EQ(place_entry(l, p, 0, 5, 0).rank, 1);
    EXPECT_EQ(place_entry(l, p, 0, 5, 0).row, 4);
    EXPECT_EQ(group_entries(l, p, 0, 8), 0);
    EXPECT_EQ(p.stats->replicas_in[0], 1);  // the placed slot counts, rows or not
    EXPECT_EQ(p.stats->replicas_out[1], 1);
    EXPECT_EQ(p.stats->total_replicas, 1);
    EXPECT_EQ(p.stats->max_load_after, 4);
}

TEST(PlannerStatic, BadPlacementsNameTheEntry) {
    const Layout l = static_layout(2, 8, 4, 1, 1, 2);  // epn 4, B 2
    auto bad = [&](const Ints& placement) { return planner::check_placement(l, placement); };
    EXPECT_EQ(bad({4, -1, 0, 1}), "");
    EXPECT_EQ(bad({-1, -1, -1, -1}), "");
    EXPECT_EQ(bad({4, -1, 0}), "placement must have R*B = 2*2 = 4 entries ([R][B] expert ids, -1 = empty), got 3");
    EXPECT_EQ(bad({4, 8, 0, 1}), "placement[0][1] = 8 is not an expert id in [0, E=8) or -1 (empty)");
    EXPECT_EQ(bad({4, -2, 0, 1}), "placement[0][1] = -2 is not an expert id in [0, E=8) or -1 (empty)");
    EXPECT_EQ(bad({4, 5, 6, 1}), "placement[1][0] = 6 is rank 1's own expert; a slot holds another rank's expert");
    EXPECT_EQ(bad({4, 4, 0, 1}), "placement[0][1] = 4 repeats placement[0][0] (an expert at most once a rank)");
    EXPECT_EQ(error_of([&] {
                  planner::make_placement_table(l, Ints{0, 1, 2, 3});
              }),
              "placement[0][0] = 0 is rank 0's own expert; a slot holds another rank's expert");
    // The planner needs the table, and a layout made for it.
    planner::HostPlan plan(l);
    EXPECT_EQ(error_of([&] { planner::plan_counts(l, PlannerKind::kStatic, plan.view); }),
              "planner static needs a placement table (make_placement_table), got null");
    const Layout balanced = test::make_test_layout(2, 8, 4, 1);
    planner::HostPlan other(balanced);
    const Ints table = planner::make_placement_table(l, Ints{4, -1, 0, 1});
    EXPECT_EQ(error_of([&] { planner::plan_counts(balanced, PlannerKind::kStatic, other.view, table.data()); }),
              "planner static on a layout made for a balancing planner: make_layout(config, planner) with the same "
              "kind");
    EXPECT_EQ(error_of([&] { planner::plan_counts(l, PlannerKind::kBalanced, plan.view); }),
              "planner balanced on a layout made for the static planner: make_layout(config, planner) with the same "
              "kind");
}

// check_plan catches a static plan that breaks the rule: rows moved between copies, a slot table that is not the
// placement, a slot beyond B.
TEST(PlannerStatic, CheckPlanCatchesBrokenStaticPlans) {
    const Layout l = static_layout(2, 4, 4, 1, 1, -1);
    const Ints placement = {2, -1, -1, 0};
    const Ints counts = {1, 1, 2, 0, 2, 0, 1, 1};
    {
        auto plan = static_plan(l, counts, placement);
        plan->view.alloc[0] -= 1;  // e0: one entry from rank 0's copy to rank 1's (conservation holds)
        plan->view.alloc[4] += 1;
        EXPECT_EQ(planner::check_plan(l, plan->view).rfind("static split: alloc[0][0] = 1, expected 2", 0), 0u)
            << planner::check_plan(l, plan->view);
    }
    {
        auto plan = static_plan(l, counts, placement);
        const Ints other = {2, -1, 0, -1};  // the same copies, another order
        EXPECT_EQ(planner::check_plan(l, plan->view, other.data()),
                  "slot_expert[1][0] = -1, expected the placement's 0");
    }
    {
        const Layout s = static_layout(2, 8, 4, 1, 1, 1);
        auto plan = static_plan(s, {2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0}, {5, -1});
        plan->view.slot_expert[1] = 6;  // slot 1 of rank 0 (j >= B)
        EXPECT_EQ(planner::check_plan(s, plan->view), "slot_expert[0][1] = 6, expected -1 (slot 1 >= B = 1)");
    }
}

// The oracle: alloc from the rule, written out (round-robin from copy e mod n over the copies in ascending rank).
Ints oracle_alloc(const Layout& l, const Ints& counts, const Ints& placement) {
    const int R = l.num_ranks, E = l.num_experts, B = l.num_slots;
    Ints alloc(size_t(R) * E, 0);
    for (int e = 0; e < E; ++e) {
        std::vector<int> copies;
        int t = 0;
        for (int d = 0; d < R; ++d) {
            t += counts[size_t(d) * E + e];
            const auto row = placement.begin() + int64_t(d) * B;
            if (l.home_rank(e) == d || std::find(row, row + B, e) != row + B) copies.push_back(d);
        }
        const int n = int(copies.size());
        for (int i = 0; i < t; ++i) ++alloc[size_t(copies[size_t((e % n + i) % n)]) * E + e];
    }
    return alloc;
}

// Many random shapes, count matrices and placements (empty slots anywhere, any order, experts placed on several
// ranks): every plan passes check_plan, has the oracle's allocation, the placement as its slot table on every rank,
// group ends inside the receive buffer, every entry of every source placed on a copy of its expert, and is the same
// plan when made again (determinism).
TEST(PlannerStatic, InvariantsOverRandomCountsAndPlacements) {
    uint64_t state = 2024;
    auto below = [&](int n) { return int(routing::mix64(state++) % uint64_t(n)); };
    int plans = 0, empty_copies = 0, multi_copies = 0;
    for (int it = 0; it < 400; ++it) {
        const int R = 1 + below(6), epn = 1 + below(it % 5 == 0 ? 24 : 6), E = R * epn;
        const int S = 1 + below(40), K = 1 + below(std::min(E, 6)), align = 1 + below(3) * 3;
        const int B = below(3) == 0 ? -1 : below(epn + 1);
        const int Q = B >= 0 && B < epn && below(2) == 0 ? epn + below(3) : 0;
        const Layout l = static_layout(R, E, S, K, align, B, Q);
        const int slots = l.num_slots;
        Ints placement(size_t(R) * slots, -1);
        for (int d = 0; d < R && R > 1; ++d) {
            for (int j = 0; j < slots; ++j) {
                if (below(4) == 0) continue;
                const int e = below(E);
                const auto row = placement.begin() + int64_t(d) * slots;
                if (e / epn != d && std::find(row, row + slots, e) == row + slots) placement[size_t(d) * slots + j] = e;
            }
        }
        const double sigma = 0.5 * below(6);
        const Ints counts = routing::generate_counts(R, E, S, K, sigma, uint64_t(it) + 1);
        const std::string what = "it=" + std::to_string(it) + " " + test::describe(l, PlannerKind::kStatic) +
                                 " B=" + std::to_string(slots) + " Q=" + std::to_string(l.view_stride);
        auto plan = static_plan(l, counts, placement);
        const PlanView& p = plan->view;
        ASSERT_EQ(planner::check_plan(l, p, placement.data()), "") << what;
        const Ints want = oracle_alloc(l, counts, placement);
        ASSERT_EQ(copy_of(p.alloc, int64_t(R) * E), want) << what;
        for (int d = 0; d < R; ++d) {
            Ints row(placement.begin() + int64_t(d) * slots, placement.begin() + int64_t(d + 1) * slots);
            row.resize(size_t(epn), -1);
            ASSERT_EQ(copy_of(p.slot_expert + int64_t(d) * epn, epn), row) << what << " rank " << d;
            int64_t load = 0;
            for (int e = 0; e < E; ++e) load += want[size_t(d) * E + e];
            ASSERT_EQ(p.stats->loads_after[d], load) << what;
            ASSERT_LE(p.cu_seqlens[int64_t(d + 1) * l.num_groups() - 1], l.num_recv_rows) << what;
            for (int j = 0; j < slots; ++j) {
                const int e = placement[size_t(d) * slots + j];
                empty_copies += e >= 0 && want[size_t(d) * E + e] == 0;
            }
        }
        for (int e = 0; e < E; ++e) {
            int copies = 0;
            for (int d = 0; d < R; ++d)
                copies += std::count(placement.begin() + int64_t(d) * slots, placement.begin() + int64_t(d + 1) * slots,
                                     e) > 0;
            multi_copies += copies >= 2;
            for (int s = 0; s < R; ++s) {
                for (int j = 0; j < counts[size_t(s) * E + e]; ++j) {
                    const EntryPlace at = place_entry(l, p, s, e, j);
                    ASSERT_GE(at.rank, 0) << what;
                    const auto row = placement.begin() + int64_t(at.rank) * slots;
                    ASSERT_TRUE(l.home_rank(e) == at.rank || std::find(row, row + slots, e) != row + slots) << what;
                }
            }
        }
        auto again = static_plan(l, counts, placement);
        const int64_t words = make_plan_sizes(l).total_words;
        ASSERT_EQ(copy_of(again->view.tpe_all, words), copy_of(p.tpe_all, words)) << what;  // the whole plan
        ++plans;
    }
    EXPECT_EQ(plans, 400);
    EXPECT_GT(empty_copies, 50);  // placed copies without rows this step: their slot groups stay, empty
    EXPECT_GT(multi_copies, 50);  // experts placed on two ranks or more
}

}  // namespace
}  // namespace flatep
