// The planner's building blocks against the obvious one-at-a-time code they replace (the GPU needs them in a few
// warp-wide steps), and every candidate of the balanced planner against hashes recorded from the version whose GPU
// planner was last checked bitwise on the H200 (test_gpu_ops --case planner_sweep), so any change of a plan shows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "flatep/config.hpp"
#include "planner/planner_core.hpp"
#include "routing/routing.hpp"

namespace flatep {
namespace {

using planner::SerialExec;

TEST(PlannerSteps, AheadSumsFollowValueThenIndex) {
    // Order: 9 (i=2), 5 (i=0), 5 (i=4), 3 (i=5), 1 (i=1); zero and negative items are not ranked.
    const std::vector<int32_t> v = {5, 1, 9, 0, 5, 3, -2};
    std::vector<int32_t> out(v.size(), 77);
    SerialExec{}.ahead_sums(int(v.size()), v.data(), out.data());
    EXPECT_EQ(out, (std::vector<int32_t>{9, 22, 0, -1, 14, 19, -1}));
}

TEST(PlannerSteps, GroupSumAndMax) {
    const std::vector<int32_t> v = {1, 7, 3, 0, 0, 0, -4, 2, 2};
    std::vector<int32_t> sum(3, -1), max(3, -1);
    SerialExec{}.group_sum(3, 3, v.data(), sum.data());
    SerialExec{}.group_max(3, 3, v.data(), max.data());
    EXPECT_EQ(sum, (std::vector<int32_t>{11, 0, 0}));
    EXPECT_EQ(max, (std::vector<int32_t>{7, 0, 2}));  // at least 0
}

TEST(PlannerSteps, ArgMax3IsThreeArgMaxes) {
    std::mt19937_64 rng(9);
    for (int trial = 0; trial < 300; ++trial) {
        const int n = 1 + int(rng() % 40);
        std::vector<planner::Keys3> keys(n);
        for (auto& k : keys)
            for (uint64_t& v : k.k) v = rng() % 4 == 0 ? 0 : (rng() % 5) << (trial % 2 ? 33 : 0);  // ties and zeros
        int out[3] = {7, 7, 7};
        SerialExec{}.arg_max3(
            n, [&](int i) { return keys[size_t(i)]; }, out);
        for (int j = 0; j < 3; ++j) {
            const int want = SerialExec{}.arg_max(n, [&](int i) { return keys[size_t(i)].k[j]; });
            ASSERT_EQ(out[j], want) << "trial " << trial << " key " << j;
        }
    }
}

// The flow of path_candidate as it was written before send_largest_first: one piece at a time.
bool send_piece_by_piece(const Layout& l, int32_t* alloc, const planner::Workspace& w, int src, int dst, int32_t need) {
    while (need > 0) {
        const int best = planner::largest_home_expert(SerialExec{}, l, alloc, src);
        if (best < 0 || w.num_in[dst] >= l.experts_per_rank) return false;
        const int32_t piece = std::min(need, alloc[src * l.num_experts + best]);
        planner::move_entries(l, alloc, w, best, dst, piece);
        ++w.num_in[dst];
        ++w.num_out[src];
        need -= piece;
    }
    return true;
}

TEST(PlannerSteps, SendLargestFirstEqualsPieceByPiece) {
    std::mt19937 rng(11);
    int compared = 0, refused = 0, multi = 0, beyond = 0;
    for (int epn : {1, 3, 8, 33, 48, 64, 70}) {
        for (int trial = 0; trial < 60; ++trial) {
            Config c;
            c.num_ranks = 3, c.num_experts = 3 * epn, c.num_tokens = 64, c.topk = 1;
            const Layout l = make_layout(c);
            const int E = l.num_experts;
            std::vector<int32_t> ws_a(planner::planner_workspace_words(l), -3), ws_b(ws_a.size(), -5);
            const planner::Workspace wa = planner::make_workspace(l, ws_a.data());
            const planner::Workspace wb = planner::make_workspace(l, ws_b.data());
            std::vector<int32_t> a(3 * E, 0);
            // Home allocations of rank 1 with ties and zeros; earlier replicas on rank 2.
            std::uniform_int_distribution<int> value(0, trial % 3 == 0 ? 4 : 40);
            for (int e = epn; e < 2 * epn; ++e) a[E + e] = value(rng);
            const int32_t home = std::accumulate(a.begin() + E + epn, a.begin() + E + 2 * epn, 0);
            for (int r = 0; r < 3; ++r) {
                wa.load[r] = wb.load[r] = 100 * r;
                wa.num_in[r] = wb.num_in[r] = r == 2 ? int32_t(rng() % (epn + 1)) : 0;
                wa.num_out[r] = wb.num_out[r] = 1;
            }
            std::vector<int32_t> b = a;
            const int32_t need = 1 + int32_t(rng() % uint32_t(home + 3));  // sometimes more than rank 1 holds
            const bool ok_a = planner::send_largest_first(SerialExec{}, l, a.data(), wa, 1, 2, need);
            const bool ok_b = send_piece_by_piece(l, b.data(), wb, 1, 2, need);
            ASSERT_EQ(ok_a, ok_b) << "epn " << epn << " trial " << trial << " need " << need;
            if (ok_a) {
                ASSERT_EQ(a, b) << "epn " << epn << " trial " << trial;
                for (int r = 0; r < 3; ++r) {
                    ASSERT_EQ(wa.load[r], wb.load[r]);
                    ASSERT_EQ(wa.num_in[r], wb.num_in[r]);
                    ASSERT_EQ(wa.num_out[r], wb.num_out[r]);
                }
                multi += wa.num_out[1] > 2;
                beyond += wa.num_out[1] - 1 > planner::kLoopPieces;  // the rest computed at once
                ++compared;
            } else {
                ++refused;
            }
        }
    }
    EXPECT_GT(compared, 150);
    EXPECT_GT(refused, 20);
    EXPECT_GT(multi, 50);   // flows of several pieces, not only the one-piece shortcut
    EXPECT_GT(beyond, 20);  // flows of more pieces than send_largest_first takes one at a time
}

// path_order as it was written before path_key: a pairwise scan.
int path_order_pairwise(const Layout& l, const planner::Workspace& w, int variant, std::vector<int32_t>& order) {
    const int R = l.num_ranks;
    std::vector<int32_t> used(R, 0);
    int m = 0;
    int64_t prefix = 0;
    for (int step = 0; step < R; ++step) {
        int pick = -1;
        for (int r = 0; r < R; ++r) {
            if (used[r] || w.excess[r] == 0) continue;
            if (pick < 0) {
                pick = r;
                continue;
            }
            const int64_t a = prefix + w.excess[r], b = prefix + w.excess[pick];
            const int64_t abs_a = a < 0 ? -a : a, abs_b = b < 0 ? -b : b;
            if (variant >= 2) {
                const bool fa = a >= 0 && a <= w.room[r], fb = b >= 0 && b <= w.room[pick];
                if (fa != fb) {
                    if (fa) pick = r;
                } else if (fa ? (variant == 2 ? a < b : a > b) : abs_a < abs_b) {
                    pick = r;
                }
            } else if (variant == 0 || m == 0) {
                if (w.excess[r] > w.excess[pick]) pick = r;
            } else if (abs_a < abs_b || (abs_a == abs_b && w.excess[r] > w.excess[pick])) {
                pick = r;
            }
        }
        if (pick < 0) break;
        used[pick] = 1;
        order[m++] = pick;
        prefix += w.excess[pick];
    }
    return m;
}

TEST(PlannerSteps, PathOrderEqualsPairwiseScan) {
    std::mt19937 rng(5);
    for (int R : {2, 3, 8, 17, 64}) {
        Config c;
        c.num_ranks = R, c.num_experts = R, c.num_tokens = 64, c.topk = 1;
        const Layout l = make_layout(c);
        std::vector<int32_t> ws(planner::planner_workspace_words(l));
        const planner::Workspace w = planner::make_workspace(l, ws.data());
        for (int trial = 0; trial < 200; ++trial) {
            // Surpluses summing to zero, with ties and zeros; rooms around them.
            const int span = trial % 4 == 0 ? 3 : 1000;
            int32_t sum = 0;
            for (int r = 0; r + 1 < R; ++r) {
                w.excess[r] = int32_t(rng() % uint32_t(2 * span + 1)) - span;
                sum += w.excess[r];
            }
            w.excess[R - 1] = -sum;
            for (int r = 0; r < R; ++r) w.room[r] = int32_t(rng() % uint32_t(2 * span + 1));
            for (int variant = 0; variant < planner::kNumPathVariants; ++variant) {
                std::vector<int32_t> want(R, -1), used(R, 0), got(R, -1);
                const int m_want = path_order_pairwise(l, w, variant, want);
                const int m_got = planner::path_order(SerialExec{}, l, w, variant, got.data(), used.data());
                ASSERT_EQ(m_got, m_want) << "R " << R << " trial " << trial << " variant " << variant;
                ASSERT_EQ(got, want) << "R " << R << " trial " << trial << " variant " << variant;
            }
        }
    }
}

// An executor with the precomputed home order of the GPU's path candidates (home_ahead), from the counts.
struct HomeAheadExec : SerialExec {
    const int32_t* table = nullptr;  // [E]
    int* used = nullptr;             // calls that returned the table
    int epn = 1;
    const int32_t* home_ahead(int r) const {
        ++*used;
        return table + r * epn;
    }
};

TEST(PlannerSteps, PathCandidatesWithHomeAheadTableAsWithout) {
    int used = 0, multi = 0;
    for (int R : {2, 5, 8}) {
        for (int epn : {1, 4, 48}) {
            for (double sigma : {0.0, 1.0, 3.0, 6.0}) {
                for (double factor : {1.0, 1.25}) {
                    Config c;
                    c.num_ranks = R, c.num_experts = R * epn, c.topk = std::min(8, R * epn);
                    c.num_tokens = 1024, c.capacity_factor = factor;
                    const Layout l = make_layout(c);
                    const int E = c.num_experts;
                    const std::vector<int32_t> tpe = routing::generate_counts(R, E, c.num_tokens, c.topk, sigma, 3);
                    std::vector<int32_t> total(E, 0), table(E, 0);
                    for (int s = 0; s < R; ++s)
                        for (int e = 0; e < E; ++e) total[e] += tpe[s * E + e];
                    for (int r = 0; r < R; ++r) SerialExec{}.ahead_sums(epn, &total[r * epn], &table[r * epn]);
                    HomeAheadExec x;
                    x.table = table.data(), x.used = &used, x.epn = epn;
                    std::vector<int32_t> ws_a(planner::planner_workspace_words(l)), ws_b(ws_a.size());
                    const planner::Workspace wa = planner::make_workspace(l, ws_a.data());
                    const planner::Workspace wb = planner::make_workspace(l, ws_b.data());
                    for (int i = 0; i < planner::kNumPathVariants; ++i) {
                        const bool ok_a = planner::build_candidate(x, l, tpe.data(), wa.cand, wa, i);
                        const bool ok_b = planner::build_candidate(SerialExec{}, l, tpe.data(), wb.cand, wb, i);
                        ASSERT_EQ(ok_a, ok_b) << "R " << R << " epn " << epn << " sigma " << sigma << " path " << i;
                        if (!ok_a) continue;
                        ASSERT_TRUE(std::equal(wa.cand, wa.cand + R * E, wb.cand))
                            << "R " << R << " epn " << epn << " sigma " << sigma << " path " << i;
                        for (int r = 0; r < R; ++r) multi += wa.num_out[r] > 1;
                    }
                }
            }
        }
    }
    EXPECT_GT(used, 100);
    EXPECT_GT(multi, 20);  // flows of several experts taken from the table
}

// An executor that, like the GPU planner, has put the home allocation, T_e, the group loads and the fixed targets in
// place before a candidate runs (home_ready, targets_ready): every candidate and the greedy must come out as when
// they compute these themselves.
struct PrecomputedExec : SerialExec {
    int64_t n = 0;
    FLATEP_HD bool home_ready(const int32_t*, int64_t* ready) const {
        *ready = n;
        return true;
    }
    FLATEP_HD bool targets_ready() const { return true; }
};

TEST(PlannerSteps, PrecomputedHomeAndTargetsAsComputed) {
    int compared = 0;
    for (int R : {2, 5, 8}) {
        for (int epn : {1, 4}) {
            for (double sigma : {0.0, 1.5, 3.0}) {
                for (double factor : {1.0, 1.25}) {
                    Config c;
                    c.num_ranks = R, c.num_experts = R * epn, c.topk = std::min(4, R * epn);
                    c.num_tokens = 64, c.capacity_factor = factor;
                    const Layout l = make_layout(c);
                    const int64_t re = int64_t(R) * c.num_experts;
                    const std::vector<int32_t> tpe = routing::generate_counts(R, c.num_experts, 64, c.topk, sigma, 5);
                    // The precomputed state: init_home and fixed_targets once.
                    std::vector<int32_t> ready(planner::planner_workspace_words(l), -9), home(re);
                    const planner::Workspace w0 = planner::make_workspace(l, ready.data());
                    PrecomputedExec x;
                    x.n = planner::init_home(SerialExec{}, l, tpe.data(), home.data(), w0);
                    planner::fixed_targets(l, x.n, w0);
                    auto run = [&](auto exec, int index, std::vector<int32_t>& alloc) {
                        std::vector<int32_t> ws = ready;  // a fresh copy of the precomputed workspace each time
                        const planner::Workspace w = planner::make_workspace(l, ws.data());
                        alloc = home;
                        if (index < 0) {
                            planner::greedy_alloc(exec, l, tpe.data(), alloc.data(), w);
                            return true;
                        }
                        return planner::build_candidate(exec, l, tpe.data(), alloc.data(), w, index);
                    };
                    for (int i = -1; i < planner::num_candidates(3); ++i) {
                        std::vector<int32_t> a, b;
                        const bool ok_a = run(x, i, a), ok_b = run(SerialExec{}, i, b);
                        ASSERT_EQ(ok_a, ok_b) << "candidate " << i << " R " << R << " epn " << epn;
                        if (ok_a) ASSERT_EQ(a, b) << "candidate " << i << " R " << R << " epn " << epn;
                        ++compared;
                    }
                }
            }
        }
    }
    EXPECT_EQ(compared, 36 * (planner::num_candidates(3) + 1));
}

uint64_t mix(uint64_t h, uint64_t v) { return h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2)); }

TEST(PlannerSteps, EveryCandidateAsRecorded) {
    // Hash of the balanced plan and of every candidate (built or not, and its allocation) per input, in loop order.
    const uint64_t recorded[] = {
        0xb092e2a12ea00620ull, 0xb092e2a12ea00620ull, 0xb092e2a12ea00620ull, 0xb092e2a12ea00620ull,
        0xb092e2a12ea00620ull, 0xb092e2a12ea00620ull, 0xa0de3bd7ec40ef7aull, 0xa0de3bd7ec40ef7aull,
        0xa0de3bd7ec40ef7aull, 0xa0de3bd7ec40ef7aull, 0xa0de3bd7ec40ef7aull, 0xa0de3bd7ec40ef7aull,
        0xdf4a4e99f5ac38dcull, 0x73d7ab88a308d5b1ull, 0x9ab7b58f9a82c0a0ull, 0xb5f9d96a5d442be9ull,
        0x9999c2b474c41088ull, 0x5062603b69f8b0a7ull, 0x7d76771309329f87ull, 0x7d76771309329f87ull,
        0x7d76771309329f87ull, 0x7d76771309329f87ull, 0x7d76771309329f87ull, 0x7d76771309329f87ull,
        0x2dbf7a5bd96cd718ull, 0xb928acdb25e49556ull, 0xf6a4ef000077c93cull, 0x40315ae75c5d53e2ull,
        0x4364075744ef488bull, 0x87f1d0f477414859ull, 0x7c535206b805cd46ull, 0x7dab97ced55b0258ull,
        0x190ff9113cd0212aull, 0x13e822e5b03551c7ull, 0x51a15eba36365e10ull, 0x764ccbc9721d88b9ull,
        0x57fdbf074b3c3b46ull, 0x57fdbf074b3c3b46ull, 0x57fdbf074b3c3b46ull, 0x57fdbf074b3c3b46ull,
        0x57fdbf074b3c3b46ull, 0x57fdbf074b3c3b46ull, 0x3d37df1d50c0c506ull, 0x1ab48335a0a2a70aull,
        0xae2f7e4e24d5d29cull, 0x35925878a51f2b94ull, 0x27bb2a783b5e5af1ull, 0x0f24163b9d9a7278ull,
        0x5b46bc38b6c10d66ull, 0xcbd813a6539e8c93ull, 0x18c77196d43b1be0ull, 0xa7c51fdfb65b18f8ull,
        0xad2ed59f9d3beb7cull, 0x54a00b0201fa6157ull,
    };
    int at = 0;
    for (int R : {2, 5, 8}) {
        for (int epn : {1, 4, 48}) {
            for (double sigma : {0.0, 1.0, 3.0}) {
                for (double factor : {1.0, 1.25}) {
                    Config c;
                    c.num_ranks = R, c.num_experts = R * epn, c.topk = std::min(8, R * epn);
                    c.num_tokens = R <= 4 ? 512 : (R == 8 && epn == 48 ? 8192 : 1024);
                    c.capacity_factor = factor;
                    const Layout l = make_layout(c);
                    const std::vector<int32_t> tpe =
                        routing::generate_counts(R, c.num_experts, c.num_tokens, c.topk, sigma, 1);
                    std::vector<int32_t> ws(planner::planner_workspace_words(l)), alloc(R * c.num_experts);
                    const planner::Workspace w = planner::make_workspace(l, ws.data());
                    planner::plan_alloc(l, PlannerKind::kBalanced, tpe.data(), alloc.data(), ws.data());
                    uint64_t h = 0;
                    for (int32_t v : alloc) h = mix(h, uint32_t(v));
                    for (int i = 0; i < planner::num_candidates(8); ++i) {
                        const bool ok = planner::build_candidate(l, tpe.data(), w.cand, w, i);
                        h = mix(h, ok);
                        if (ok)
                            for (int j = 0; j < R * c.num_experts; ++j) h = mix(h, uint32_t(w.cand[j]));
                    }
                    EXPECT_EQ(h, recorded[at])
                        << "R " << R << " epn " << epn << " sigma " << sigma << " factor " << factor;
                    ++at;
                }
            }
        }
    }
    EXPECT_EQ(at, int(sizeof(recorded) / sizeof(recorded[0])));
}

}  // namespace
}  // namespace flatep
