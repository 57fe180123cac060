// The planner's rules of ties and order, each on an input where the other choice gives a different plan: slack-mode
// targets and the greedy's receiver and expert selections break ties toward the lower index (planner_core.hpp), and
// rows inside a destination group are ordered by (source rank, token, k) (design §4, §5; plan.hpp's split rule).
// The golden values are worked out by hand in the comments, not read back from the planner.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <vector>

#include "planner_test_util.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using test::copy_of;
using test::describe;
using test::make_test_layout;
using test::plan_of;

constexpr PlannerKind kBothPlanners[] = {PlannerKind::kGreedy, PlannerKind::kBalanced};

// R=4, E=4 (epn=1), S=5, K=1, capacity_factor 2: C = 10. tpe rows [5,0,0,0], [3,2,0,0], [3,0,2,0], [3,0,0,2]:
// T = G = [14,2,2,2]. Only rank 0 is above C, by 4. Fixed targets: [10,2,2,2], then the 4 go to the rank with the
// most room; ranks 1, 2 and 3 tie at 8, so rank 1 (the lower) gets them: targets [10,6,2,2]. The greedy fills rank 1
// from rank 0's only expert: alloc[1][0] = 4.
// Balanced: the greedy's plan has P = 1, one replica, and moves 6 entries (sources 2 and 3 spill their 3 e0 entries
// each); any one-replica plan receiving m in [4, 8] entries of e0 on rank r keeps min(3, m) = 3 there and 5 on rank 0,
// so it moves 14 - 8 = 6 as well: no candidate is strictly better and the greedy's plan stays.
// Split rule for e0: keep = [5,3,0,0]; spill stream: source 2 at [0,3), source 3 at [3,6); take ranges: rank 0 [0,5),
// rank 1 [5,6). Rows inside rank 1's slot group (starting at row 2, after e1's 2 rows) are source 1's three kept
// entries, then source 3's last spilled one; inside rank 0's e0 group source 0's five, source 2's three, source 3's
// two.
TEST(PlannerOrder, SlackTargetsTieToTheRankWithTheLowerIndex) {
    const Layout l = make_test_layout(4, 4, 5, 1, /*align=*/1, /*capacity_factor=*/2.0);
    ASSERT_EQ(l.capacity, 10);
    const std::vector<int32_t> counts = {5, 0, 0, 0, 3, 2, 0, 0, 3, 0, 2, 0, 3, 0, 0, 2};
    for (PlannerKind kind : kBothPlanners) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        ASSERT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 16), (std::vector<int32_t>{10, 0, 0, 0, 4, 2, 0, 0, 0, 0, 2, 0, 0, 0, 0, 2}));
        EXPECT_EQ(copy_of(p.slot_expert, 4), (std::vector<int32_t>{-1, 0, -1, -1}));
        EXPECT_EQ(copy_of(p.cu_seqlens, 8), (std::vector<int32_t>{10, 10, 2, 6, 2, 2, 2, 2}));
        EXPECT_EQ(p.stats->entries_moved, 6);
        // (source, j-th e0 entry of that source) -> (rank, row).
        const std::vector<std::array<int, 4>> places = {
            {0, 0, 0, 0}, {0, 4, 0, 4}, {1, 0, 1, 2}, {1, 2, 1, 4}, {2, 0, 0, 5},
            {2, 2, 0, 7}, {3, 0, 0, 8}, {3, 1, 0, 9}, {3, 2, 1, 5},
        };
        for (const auto& [src, j, rank, row] : places) {
            const EntryPlace at = place_entry(l, p, src, 0, j);
            EXPECT_EQ(at.rank, rank) << "source " << src << " j " << j;
            EXPECT_EQ(at.row, row) << "source " << src << " j " << j;
        }
    }
}

// R=3, E=6 (epn=2), S=2, K=1, exact: every rank routes one entry to e0 and one to e1 (both on rank 0). T = [3,3,0..],
// G = [6,0,0], targets 2 each. Greedy fill 1: ranks 1 and 2 tie at deficit 2 -> rank 1; rank 0's home experts tie at
// 3 -> e0; rank 1 takes 2 of e0. Fill 2: rank 2 takes 2 of e1, now the larger. Flipping either tie gives rank 1 e1
// and rank 2 e0.
// Balanced: rank 0 must shed 4 into two rooms of 2 and a replica never passes entries on, so P = 2 and two replicas
// are the least; each receiver hosts 2 entries of an expert it sourced once: 2 entries moved at the least. No
// candidate is strictly better; the greedy's plan stays.
TEST(PlannerOrder, GreedyReceiverAndDonorExpertTiesGoToTheLowerIndex) {
    const Layout l = make_test_layout(3, 6, 2, 1);
    const std::vector<int32_t> counts = {1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0};
    for (PlannerKind kind : kBothPlanners) {
        SCOPED_TRACE(planner_name(kind));
        auto plan = plan_of(l, counts, kind);
        const PlanView& p = plan->view;
        ASSERT_EQ(planner::check_plan(l, p), "");
        EXPECT_EQ(copy_of(p.alloc, 18), (std::vector<int32_t>{1, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0}));
        EXPECT_EQ(copy_of(p.slot_expert, 6), (std::vector<int32_t>{-1, -1, 0, -1, 1, -1}));
        EXPECT_EQ(p.stats->makespan, 2);
        EXPECT_EQ(p.stats->total_replicas, 2);
        EXPECT_EQ(p.stats->entries_moved, 2);
    }
}

// Rows of one destination group, as (source rank, token, k) keys in row order.
using EntryKey = std::array<int, 3>;

// Every group of every rank holds its entries at consecutive rows from the group's start, in ascending (source rank,
// token, k). The keys are collected from the routing itself: only the rows come from the plan.
TEST(PlannerOrder, RowsInsideEveryGroupAreOrderedBySourceTokenK) {
    int groups_with_several_sources = 0;
    for (int R : {2, 3, 4}) {
        for (int epn : {1, 3}) {
            for (double cf : {1.0, 1.5}) {
                for (double sigma : {0.0, 2.0}) {
                    const int E = R * epn, S = 9, K = std::min(E, 3);
                    const Layout l = make_test_layout(R, E, S, K, /*align=*/4, cf);
                    const std::vector<double> pop = routing::popularity(E, sigma, 5);
                    std::vector<std::vector<int32_t>> idx(R, std::vector<int32_t>(size_t(S) * K));
                    std::vector<int32_t> counts;
                    for (int s = 0; s < R; ++s) {
                        routing::sample_topk(pop, S, K, 5, s, idx[s].data());
                        const std::vector<int32_t> h = routing::histogram(idx[s].data(), int64_t(S) * K, E);
                        counts.insert(counts.end(), h.begin(), h.end());
                    }
                    for (PlannerKind kind : kBothPlanners) {
                        SCOPED_TRACE(describe(l, kind) + " sigma=" + std::to_string(sigma));
                        auto plan = plan_of(l, counts, kind);
                        const PlanView& p = plan->view;
                        // (rank, expert) -> (row, key) of every entry computed there.
                        std::map<std::pair<int, int>, std::vector<std::pair<int, EntryKey>>> groups;
                        for (int s = 0; s < R; ++s) {
                            ASSERT_EQ(planner::route_entries(l, p, s, idx[s].data(), 4, S), -1);
                            for (int t = 0; t < S; ++t) {
                                for (int k = 0; k < K; ++k) {
                                    const int i = t * K + k;
                                    groups[{p.entry_rank[i], idx[s][i]}].push_back({p.entry_row[i], {s, t, k}});
                                }
                            }
                        }
                        for (auto& [where, rows] : groups) {
                            const auto [d, e] = where;
                            const int32_t start = p.group_row[d * E + e];
                            ASSERT_GE(start, 0) << "rank " << d << " expert " << e;
                            std::sort(rows.begin(), rows.end(),
                                      [](const auto& a, const auto& b) { return a.second < b.second; });
                            int sources = 0;
                            for (size_t i = 0; i < rows.size(); ++i) {
                                const auto& [row, key] = rows[i];
                                ASSERT_EQ(row, start + int(i))
                                    << "rank " << d << " expert " << e << ": entry (source " << key[0] << ", token "
                                    << key[1] << ", k " << key[2] << ") is number " << i << " in (s, t, k) order";
                                if (i == 0 || rows[i - 1].second[0] != key[0]) ++sources;
                            }
                            if (sources > 1) ++groups_with_several_sources;
                        }
                    }
                }
            }
        }
    }
    EXPECT_GE(groups_with_several_sources, 50);  // the order between sources is exercised, not only inside one
}

}  // namespace
}  // namespace flatep
